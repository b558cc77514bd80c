#!/usr/bin/python3
"""Command-line driver for the Ladder PyTorch reference (see README.md in this folder).

  run_ref.py forward-backward --dir DIR [--double]
  run_ref.py train --dir DIR --steps N
  run_ref.py init --dir DIR [options]      # writes a random test case (config + weights + batches)
  run_ref.py selftest

Must be run with a python that has torch (Debian: /usr/bin/python3).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ref_model as rm  # noqa: E402
import safetensors_io as st  # noqa: E402


# ----------------------------------------------------------------------------- I/O helpers

def load_config(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


def load_params(d, cfg, dtype):
    tensors, _ = st.load_torch(os.path.join(d, "model.safetensors"))
    params = {name: tensors[name].to(dtype) for name in rm.param_shapes(cfg) if name in tensors}
    rm.check_params(cfg, params)
    return params


def load_buffers(d, dtype):
    """The MoE selection biases (not trained; absent in dense models)."""
    tensors, _ = st.load_torch(os.path.join(d, "model.safetensors"))
    return {k: v.to(dtype) for k, v in tensors.items() if k.endswith(rm.ref_moe.BIAS)}


def load_tokens(path):
    tensors, _ = st.load_torch(path)
    return tensors["inputs"].long(), tensors["targets"].long()


# ----------------------------------------------------------------------------- commands

def cmd_forward_backward(args):
    dtype = torch.float64 if args.double else torch.float32
    raw = load_config(args.dir)
    cfg = rm.ModelConfig.from_dict(raw)
    params = load_params(args.dir, cfg, dtype)
    inputs, targets = load_tokens(os.path.join(args.dir, "batch.safetensors"))
    for p in params.values():
        p.requires_grad_(True)

    aux = {}
    logits = rm.forward(params, cfg, inputs, load_buffers(args.dir, dtype), aux)
    loss = rm.loss_fn(logits, targets, cfg.z_loss) + rm.ref_moe.router_z_loss(cfg, aux)
    loss.backward()

    out = {"logits": logits.detach().reshape(-1, cfg.vocab_size),
           "loss": loss.detach().reshape(1)}
    for name, p in params.items():
        out["grad." + name] = p.grad
    st.save_torch(os.path.join(args.dir, "ref_out.safetensors"), out,
                  metadata={"dtype": "F64" if args.double else "F32"})
    print(json.dumps({"loss": float(loss), "dtype": str(dtype)}))


def cmd_train(args):
    raw = load_config(args.dir)
    cfg = rm.ModelConfig.from_dict(raw)
    oc = rm.OptimConfig.from_dict(raw.get("optim", {}))
    if not oc.total_steps:
        oc.total_steps = args.steps
    params = load_params(args.dir, cfg, torch.float32)
    inputs, targets = load_tokens(os.path.join(args.dir, "batches.safetensors"))
    if inputs.shape[0] < args.steps:
        raise SystemExit(f"batches.safetensors holds {inputs.shape[0]} batches < --steps {args.steps}")

    opt = rm.AdamW(params, oc)
    buffers = load_buffers(args.dir, torch.float32)
    balance = cfg.moe_experts > 0 and raw.get("moe_balance", False) and cfg.moe_top_k < cfg.moe_experts
    losses, grad_norms, lrs = [], [], []
    for step in range(args.steps):
        for p in params.values():
            p.requires_grad_(True)
            p.grad = None
        aux = {}
        logits = rm.forward(params, cfg, inputs[step], buffers, aux)
        loss = rm.loss_fn(logits, targets[step], cfg.z_loss) + rm.ref_moe.router_z_loss(cfg, aux)
        loss.backward()
        if balance:  # quantile balancing from this step's tokens, once per step
            for layer, scores in zip(cfg.moe_layers, aux["router_scores"]):
                name = f"model.layers.{layer}.mlp." + rm.ref_moe.BIAS
                buffers[name] = rm.ref_moe.quantile_bias(scores, buffers[name], cfg.moe_top_k)
        grads = {k: p.grad for k, p in params.items()}
        norm = rm.clip_grads(grads, oc.clip)
        lr = rm.lr_at(step, oc)
        with torch.no_grad():
            for p in params.values():
                p.requires_grad_(False)
            opt.step(params, grads, lr)
        losses.append(float(loss))
        grad_norms.append(norm)
        lrs.append(lr)
        print(f"step {step:4d}  loss {float(loss):.6f}  grad_norm {norm:.6f}  lr {lr:.6g}")

    with open(os.path.join(args.dir, "ref_train.json"), "w") as f:
        json.dump({"losses": losses, "grad_norms": grad_norms, "lrs": lrs}, f, indent=1)
    final = {k: v.detach() for k, v in params.items()}
    final.update(buffers)
    st.save_torch(os.path.join(args.dir, "ref_final.safetensors"), final)


def cmd_init(args):
    """Writes DIR/config.json, model.safetensors, batch.safetensors and batches.safetensors."""
    os.makedirs(args.dir, exist_ok=True)
    raw = {
        "vocab_size": args.vocab, "d_model": args.d_model, "n_layers": args.layers,
        "n_heads": args.heads, "n_kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "d_ff": args.d_ff, "seq_len": args.seq_len, "rope_theta": args.rope_theta,
        "norm_eps": args.norm_eps, "window": args.window, "qk_norm": args.qk_norm,
        "z_loss": args.z_loss, "batch_size": args.batch,
        "optim": {"lr": args.lr, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                  "weight_decay": 0.1, "clip": 1.0, "warmup": 2,
                  "total_steps": args.steps, "final_lr_frac": 0.1},
    }
    if args.rope_dims:
        raw["rope_dims"] = args.rope_dims
    cfg = rm.ModelConfig.from_dict(raw)
    params = rm.init_params(cfg, seed=args.seed, std=args.std, norm_jitter=0.1)
    with open(os.path.join(args.dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=1)
    st.save_torch(os.path.join(args.dir, "model.safetensors"), params)

    # Token streams with learnable structure (next = (5*cur + 3) mod V, 10% random) so training
    # visibly lowers the loss. inputs = stream[:-1], targets = stream[1:].
    rng = np.random.default_rng(args.seed + 1)

    def make(n):
        seq = np.empty((n, args.batch, args.seq_len + 1), dtype=np.int64)
        seq[..., 0] = rng.integers(0, args.vocab, size=(n, args.batch))
        for t in range(1, args.seq_len + 1):
            nxt = (5 * seq[..., t - 1] + 3) % args.vocab
            noise = rng.integers(0, args.vocab, size=nxt.shape)
            seq[..., t] = np.where(rng.random(nxt.shape) < 0.1, noise, nxt)
        return seq[..., :-1].astype(np.int32), seq[..., 1:].astype(np.int32)

    x, y = make(1)
    st.save(os.path.join(args.dir, "batch.safetensors"), {"inputs": x[0], "targets": y[0]})
    x, y = make(args.steps)
    st.save(os.path.join(args.dir, "batches.safetensors"), {"inputs": x, "targets": y})
    print(f"wrote test case to {args.dir}")


# ----------------------------------------------------------------------------- selftest

def naive_attention(x, params, prefix, cfg):
    """Loop-per-(batch, head, query) attention used to cross-check rm.attention. Uses a
    complex-number RoPE, explicit per-position softmax, and kv head h // (H/KV)."""
    B, S, _ = x.shape
    H, KV, hd, rd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_dims
    q = (x @ params[prefix + "q_proj.weight"].t()).view(B, S, H, hd)
    k = (x @ params[prefix + "k_proj.weight"].t()).view(B, S, KV, hd)
    v = (x @ params[prefix + "v_proj.weight"].t()).view(B, S, KV, hd)

    def norm(t, w):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + cfg.norm_eps) * w

    def rope_complex(t):
        half = rd // 2
        z = torch.complex(t[..., :half], t[..., half:rd])
        out = torch.empty_like(t)
        for p in range(S):
            freqs = torch.tensor([cfg.rope_theta ** (-2.0 * i / rd) for i in range(half)],
                                 dtype=torch.float64)
            rot = torch.polar(torch.ones(half, dtype=torch.float64), p * freqs).to(z.dtype)
            zp = z[:, p] * rot
            out[:, p, :, :half] = zp.real
            out[:, p, :, half:rd] = zp.imag
        out[..., rd:] = t[..., rd:]
        return out

    if cfg.qk_norm:
        q = norm(q, params[prefix + "q_norm.weight"])
        k = norm(k, params[prefix + "k_norm.weight"])
    q, k = rope_complex(q), rope_complex(k)
    out = torch.zeros(B, S, H, hd, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            kh = h // (H // KV)
            for i in range(S):
                js = [j for j in range(S) if j <= i and (cfg.window == 0 or i - j < cfg.window)]
                s = torch.stack([q[b, i, h] @ k[b, j, kh] for j in js]) / math.sqrt(hd)
                w = torch.exp(s - s.max())
                w = w / w.sum()
                out[b, i, h] = sum(w[n] * v[b, j, kh] for n, j in enumerate(js))
    return out.reshape(B, S, H * hd) @ params[prefix + "o_proj.weight"].t()


def _tiny_cfg(**over):
    base = dict(vocab_size=11, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=4,
                d_ff=12, seq_len=6, rope_theta=10000.0, norm_eps=1e-6)
    base.update(over)
    return rm.ModelConfig.from_dict(base)


def selftest():
    torch.manual_seed(0)
    failures = []

    def check(name, ok, detail=""):
        print(f"[{'ok' if ok else 'FAIL'}] {name} {detail}")
        if not ok:
            failures.append(name)

    variants = [
        dict(),
        dict(qk_norm=True),
        dict(window=3),
        dict(qk_norm=True, window=2, rope_dims=2, n_kv_heads=1),
        dict(n_kv_heads=4, rope_theta=500.0),
    ]

    # 1. vectorized attention vs naive loops (float64)
    for over in variants:
        cfg = _tiny_cfg(**over)
        params = rm.init_params(cfg, seed=1, std=0.5, norm_jitter=0.3, dtype=torch.float64)
        x = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64)
        cos, sin = rm.rope_cos_sin(cfg.seq_len, cfg.rope_dims, cfg.rope_theta, torch.float64)
        mask = rm.attention_mask(cfg.seq_len, cfg.window)
        a = rm.attention(x, params, "model.layers.0.self_attn.", cfg, cos, sin, mask)
        b = naive_attention(x, params, "model.layers.0.self_attn.", cfg)
        err = float((a - b).abs().max())
        check(f"attention vs naive {over}", err < 1e-12, f"max_abs_err={err:.3e}")

    # 2. explicit loss vs torch's cross_entropy
    logits = torch.randn(3, 5, 7, dtype=torch.float64)
    targets = torch.randint(0, 7, (3, 5))
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1))
    lse = torch.logsumexp(logits.reshape(-1, 7), -1)
    ours = rm.loss_fn(logits, targets, 0.01)
    err = abs(float(ours - (ce + 0.01 * (lse ** 2).mean())))
    check("loss vs F.cross_entropy + z_loss", err < 1e-12, f"err={err:.3e}")

    # 3. gradcheck of the whole model (float64) for a few variants
    for over in [dict(qk_norm=True, window=3, z_loss=1e-2), dict(rope_dims=2), dict()]:
        cfg = _tiny_cfg(n_layers=1, seq_len=5, **over)
        params = rm.init_params(cfg, seed=2, std=0.3, norm_jitter=0.2, dtype=torch.float64)
        names = list(params)
        inputs = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))

        def f(*tensors):
            return rm.loss_fn(rm.forward(dict(zip(names, tensors)), cfg, inputs), targets, cfg.z_loss)

        ts = [params[n].clone().requires_grad_(True) for n in names]
        try:
            ok = torch.autograd.gradcheck(f, ts, eps=1e-6, atol=1e-7, rtol=1e-5)
        except Exception as e:  # gradcheck raises on mismatch
            print(e)
            ok = False
        check(f"gradcheck model {over}", ok)

    # 4. AdamW single (and second) step vs hand-computed scalars
    oc = rm.OptimConfig(lr=0.1, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5)
    p0 = {"a.q_proj.weight": 2.0, "lm_head.weight": -1.0, "model.norm.weight": 3.0}
    g1 = {"a.q_proj.weight": 0.5, "lm_head.weight": -0.25, "model.norm.weight": 4.0}
    g2 = {"a.q_proj.weight": -1.0, "lm_head.weight": 0.75, "model.norm.weight": 0.0}
    params = {k: torch.tensor([v], dtype=torch.float64) for k, v in p0.items()}
    opt = rm.AdamW(params, oc)
    exp = dict(p0)
    ms = {k: 0.0 for k in p0}
    vs = {k: 0.0 for k in p0}
    for t, (gd, lr) in enumerate([(g1, 0.1), (g2, 0.05)], start=1):
        opt.step(params, {k: torch.tensor([v], dtype=torch.float64) for k, v in gd.items()}, lr)
        for k in p0:
            ms[k] = 0.9 * ms[k] + 0.1 * gd[k]
            vs[k] = 0.95 * vs[k] + 0.05 * gd[k] ** 2
            decay = 0.5 if k != "model.norm.weight" else 0.0
            exp[k] = exp[k] - lr * decay * exp[k]
            exp[k] = exp[k] - lr * (ms[k] / (1 - 0.9 ** t)) / (math.sqrt(vs[k] / (1 - 0.95 ** t)) + 1e-8)
        err = max(abs(float(params[k]) - exp[k]) for k in p0)
        check(f"AdamW step {t} vs hand computation", err < 1e-14, f"err={err:.3e}")
    # first step with no decay moves every parameter by ~lr*sign(g)
    params = {"x.weight": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    rm.AdamW(params, rm.OptimConfig(lr=0.01, eps=0.0)).step(
        params, {"x.weight": torch.tensor([3.0, -0.1], dtype=torch.float64)}, 0.01)
    err = float((params["x.weight"] - torch.tensor([0.99, -1.99], dtype=torch.float64)).abs().max())
    check("AdamW first step = lr*sign(g)", err < 1e-14, f"err={err:.3e}")

    # 5. decay group rule
    cfg = _tiny_cfg(qk_norm=True)
    decayed = sorted(n for n in rm.param_shapes(cfg) if rm.uses_weight_decay(n))
    want = sorted(n for n, s in rm.param_shapes(cfg).items()
                  if len(s) == 2 and n != "model.embed_tokens.weight")
    check("weight-decay group = all matrices except embeddings", decayed == want)

    # 6. gradient clipping
    grads = {"a": torch.tensor([3.0, 0.0], dtype=torch.float64), "b": torch.tensor([4.0], dtype=torch.float64)}
    n = rm.clip_grads(grads, 1.0)
    s = 1.0 / (5.0 + 1e-6)
    ok = abs(n - 5.0) < 1e-12 and abs(float(grads["a"][0]) - 3 * s) < 1e-15 and abs(float(grads["b"][0]) - 4 * s) < 1e-15
    check("global-norm clip", ok, f"norm={n}")
    grads = {"a": torch.tensor([0.3], dtype=torch.float64)}
    n = rm.clip_grads(grads, 1.0)
    check("no clip below threshold", float(grads["a"][0]) == 0.3 and abs(n - 0.3) < 1e-15)

    # 7. LR schedule: lr=1, warmup=4, total=10, final=0.1
    oc = rm.OptimConfig(lr=1.0, warmup=4, total_steps=10, final_lr_frac=0.1)
    got = [rm.lr_at(t, oc) for t in range(11)]
    want = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.9 * (1 - (t - 4) / 6) for t in range(4, 11)]
    check("lr schedule", max(abs(a - b) for a, b in zip(got, want)) < 1e-15,
          " ".join(f"{v:.3f}" for v in got))
    oc = rm.OptimConfig(lr=2.0, warmup=0, total_steps=3, final_lr_frac=0.0)
    got = [rm.lr_at(t, oc) for t in range(4)]
    check("lr schedule no warmup", max(abs(a - b) for a, b in zip(got, [2.0, 4 / 3, 2 / 3, 0.0])) < 1e-15)

    # 8. safetensors round trip
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.safetensors")
        data = {"f32": np.random.randn(3, 4).astype(np.float32), "f64": np.random.randn(5),
                "i32": np.arange(6, dtype=np.int32).reshape(2, 3), "scalar": np.array(1.5, dtype=np.float32)}
        st.save(path, data, metadata={"k": "v"})
        back, meta = st.load(path)
        ok = meta == {"k": "v"} and all(back[k].dtype == v.dtype and back[k].shape == v.shape
                                        and np.array_equal(back[k], v) for k, v in data.items())
        n, _ = st.read_header(path)
        check("safetensors round trip", ok and n % 8 == 0)

    if failures:
        print(f"SELFTEST FAILED: {failures}")
        return 1
    print("SELFTEST PASSED")
    return 0


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("forward-backward", help="logits, loss and all grads for DIR/batch.safetensors")
    p.add_argument("--dir", required=True)
    p.add_argument("--double", action="store_true", help="compute and write in float64")

    p = sub.add_parser("train", help="N AdamW steps over DIR/batches.safetensors")
    p.add_argument("--dir", required=True)
    p.add_argument("--steps", type=int, required=True)

    p = sub.add_parser("init", help="write a random test case into DIR")
    p.add_argument("--dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=0.1, help="std of the random matrices")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-dims", type=int, default=0, help="0 = head_dim")
    p.add_argument("--norm-eps", type=float, default=1e-6)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--z-loss", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10, help="number of batches in batches.safetensors")
    p.add_argument("--lr", type=float, default=1e-2)

    sub.add_parser("selftest", help="internal consistency checks; exit 1 on failure")

    args = ap.parse_args()
    if args.cmd == "forward-backward":
        cmd_forward_backward(args)
    elif args.cmd == "train":
        cmd_train(args)
    elif args.cmd == "init":
        cmd_init(args)
    elif args.cmd == "selftest":
        sys.exit(selftest())


if __name__ == "__main__":
    main()

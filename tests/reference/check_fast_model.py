"""Is `ladder bench --torch`'s baseline the same model? scripts/torch_fast_model.py (the fast PyTorch
implementation the benchmark times) against the reference (ref_model.py), on the same weights and
tokens: logits, loss, every gradient, the quantile-balancing bias and three clipped AdamW steps with
balancing, for a dense model, a dense model with every attention and norm switch, and two MoE models.
Each check runs with each of the fast model's paths this torch has (grouped or per-expert MoE GEMMs,
native or repeated GQA).

  check_fast_model.py [--device cpu|cuda] [--precision fp32|bf16]     exit status 1 on any failure

fp32 (the default; CTest runs it with Debian's torch on the CPU): tolerances of fp32 rounding.
bf16 (a GPU: scripts/gpu-check.sh; the CPU with torch 2.x): the fast model under bf16 autocast, SDPA and grouped
GEMMs against the fp32 reference, with bounds that catch a wrong layout, not bf16 rounding.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
import ref_model as rm  # noqa: E402
import ref_moe  # noqa: E402
import torch_fast_model as fm  # noqa: E402

BASE = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48,
            seq_len=16, rope_theta=10000.0, norm_eps=1e-6, qk_norm=True, z_loss=1e-3, batch_size=2)
CONFIGS = {
    "dense (GQA, window 5, QK-norm, z-loss)": dict(window=5),
    "dense with every switch (half RoPE, plain QK-norm, q scale, long/short, PKO, XSA, gate, GatedNorm)":
        dict(window=6, rope_dims=4, qk_norm_gain=False, q_scale=1.3, long_every=2, last_layer_long=True,
             pko=True, eod_id=3, xsa=True, attn_gate=True, gated_norm_rank=4, n_layers=3),
    "MoE V1 (E=8, K=2, shared expert, router z-loss, one MoE layer)":
        dict(moe_experts=8, moe_top_k=2, moe_expert_ff=16, moe_shared_ff=32, moe_layers=[1], router_z_loss=1e-3),
    "MoE normalized x2.5, no shared expert, every layer MoE, MHA":
        dict(moe_experts=8, moe_top_k=3, moe_expert_ff=16, moe_shared_ff=0, moe_layers=[0, 1],
             moe_normalized=True, moe_route_scale=2.5, n_kv_heads=4),
}


def rel(a, b):
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def setup(raw, seed):
    cfg = rm.ModelConfig.from_dict(raw)
    params = rm.init_params(cfg, seed=seed, std=0.15, norm_jitter=0.1)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    inputs[0, 5] = inputs[1, 9] = 3  # document ends, for PKO
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)
    buffers = {f"model.layers.{i}.mlp.{ref_moe.BIAS}": 0.05 * torch.randn(cfg.moe_experts, generator=g)
               for i in (cfg.moe_layers or [])}
    return cfg, params, inputs, targets, buffers


def device_copy(params, dev):
    """The fast model's own leaf copy of the parameters, on its device."""
    return {k: v.detach().clone().to(dev).requires_grad_(True) for k, v in params.items()}


def ref_loss(cfg, params, inputs, targets, buffers, aux):
    logits = rm.forward(params, cfg, inputs, buffers, aux)
    return logits, rm.loss_fn(logits, targets, cfg.z_loss) + ref_moe.router_z_loss(cfg, aux)


def fast_loss(model, cfg, params, inputs, targets, buffers, aux, dev, bf16):
    biases = {i: buffers[f"model.layers.{i}.mlp.{ref_moe.BIAS}"].to(dev) for i in (cfg.moe_layers or [])}
    with fm.autocast(dev, bf16):
        logits = model.forward(params, inputs.to(dev), biases, aux)
    return logits, model.loss(logits, targets.to(dev), aux)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    args = ap.parse_args()
    dev, bf16 = torch.device(args.device), args.precision == "bf16"
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    # (logits, loss, gradients) bounds
    tol = (6e-2, 2e-2, 2.5e-1) if bf16 else (2e-5, 2e-5, 2e-4)
    failures = []

    def check(name, err, bound):
        ok = err <= bound
        print(f"[{'ok' if ok else 'FAIL'}] {name}: {err:.2e} (bound {bound:.1e})")
        if not ok:
            failures.append(name)

    print(f"torch {torch.__version__}, device {dev}, {args.precision}; SDPA {fm.HAS_SDPA}, "
          f"grouped GEMM {fm.GROUPED_MM is not None}, native GQA {fm.GQA_NATIVE}")
    moe_modes = ["loop"] + (["grouped"] if fm.GROUPED_MM is not None and (dev.type == "cuda" and bf16 or
                                                                           dev.type == "cpu" and fm.VERSION >= (2, 9)) else [])
    if bf16:
        moe_modes = moe_modes[1:] or moe_modes  # bf16: the path the GPU benchmark takes
    gqa_modes = ["native", "repeat"] if fm.HAS_SDPA and fm.GQA_NATIVE else ["repeat"]

    # the balancing bias, on its own (scores with no ties)
    g = torch.Generator().manual_seed(7)
    scores, bias = torch.randn(96, 8, generator=g), 0.1 * torch.randn(8, generator=g)
    check("quantile bias (T=96, E=8, K=2)", rel(fm.quantile_bias(scores.to(dev), bias.to(dev), 2).cpu(),
                                                 ref_moe.quantile_bias(scores, bias, 2)), 1e-6)

    for ci, (label, extra) in enumerate(CONFIGS.items()):
        raw = dict(BASE, **extra)
        is_moe = "moe_experts" in extra
        for mode in (moe_modes if is_moe else ["-"]):
            for gqa in gqa_modes:
                cfg, params, inputs, targets, buffers = setup(raw, seed=10 + ci)
                name = f"{label} [{'moe ' + mode + ', ' if is_moe else ''}gqa {gqa}]"
                for p in params.values():
                    p.requires_grad_(True)
                aux_r = {}
                logits_r, loss_r = ref_loss(cfg, params, inputs, targets, buffers, aux_r)
                loss_r.backward()
                fparams = device_copy(params, dev)
                model = fm.FastModel(cfg, dev, moe_gemm=mode, gqa=gqa)
                aux_f = {}
                logits_f, loss_f = fast_loss(model, cfg, fparams, inputs, targets, buffers, aux_f, dev, bf16)
                loss_f.backward()
                check(name + " logits", rel(logits_f.detach().float().cpu(), logits_r.detach()), tol[0])
                check(name + " loss", abs(loss_f.item() - loss_r.item()) / abs(loss_r.item()), tol[1])
                worst, at = 0.0, ""
                for k, p in params.items():
                    e = rel(fparams[k].grad.cpu(), p.grad)
                    if e > worst:
                        worst, at = e, k
                check(name + f" gradients (worst: {at})", worst, tol[2])
                if is_moe:
                    for a, b in zip(aux_f["router_scores"], aux_r["router_scores"]):
                        check(name + " router scores", rel(a.cpu(), b), tol[0])

                # Three steps: clip (to 0.5: every step clips), AdamW with decay, balancing. In
                # fp32 mode both models run in float64 (on the per-expert GEMMs: the grouped GEMM
                # takes no float64), since Adam's first steps are about sign(g) and would turn fp32
                # rounding of near-zero gradient elements into whole steps; the parameters must then
                # agree closely. In bf16 the losses are compared.
                if not bf16:
                    if mode != moe_modes[0] and is_moe:
                        continue  # the float64 steps of this config and GQA mode ran already
                    params = {k: v.detach().double() for k, v in params.items()}
                    buffers = {k: v.double() for k, v in buffers.items()}
                    model = fm.FastModel(cfg, dev, moe_gemm="loop", gqa=gqa)
                fparams = device_copy(params, dev)
                oc = dict(lr=2e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
                ref_opt = rm.AdamW(params, rm.OptimConfig.from_dict(dict(oc, clip=0.5)))
                fast_opt = fm.make_optimizer(fparams, oc, dev)
                rbuf = {k: v.clone() for k, v in buffers.items()}
                fbuf = {k: v.clone().to(dev) for k, v in buffers.items()}
                losses_r, losses_f = [], []
                for step in range(3):
                    for p in params.values():
                        p.requires_grad_(True)
                        p.grad = None
                    aux_r = {}
                    _, lr_ = ref_loss(cfg, params, inputs, targets, rbuf, aux_r)
                    lr_.backward()
                    fast_opt.zero_grad(set_to_none=True)
                    aux_f = {}
                    _, lf_ = fast_loss(model, cfg, fparams, inputs, targets, fbuf, aux_f, dev, bf16)
                    lf_.backward()
                    losses_r.append(lr_.item())
                    losses_f.append(lf_.item())
                    for li, layer in enumerate(cfg.moe_layers or []):
                        key = f"model.layers.{layer}.mlp.{ref_moe.BIAS}"
                        rbuf[key] = ref_moe.quantile_bias(aux_r["router_scores"][li], rbuf[key], cfg.moe_top_k)
                        fbuf[key] = fm.quantile_bias(aux_f["router_scores"][li], fbuf[key], cfg.moe_top_k)
                    rm.clip_grads({k: p.grad for k, p in params.items()}, 0.5)
                    with torch.no_grad():
                        for p in params.values():
                            p.requires_grad_(False)
                        ref_opt.step(params, {k: p.grad for k, p in params.items()}, oc["lr"])
                    torch.nn.utils.clip_grad_norm_(list(fparams.values()), 0.5)
                    fast_opt.step()
                if bf16:  # the first loss as above; Adam's sign-like first steps turn bf16 noise into
                    # whole steps after it, so the later ones within 6e-2
                    check(name + f" 3 AdamW steps: losses {losses_f} vs {losses_r}",
                          max([abs(losses_f[0] - losses_r[0]) / abs(losses_r[0]) * 3] +
                              [abs(a - b) / abs(b) for a, b in zip(losses_f[1:], losses_r[1:])]), 6e-2)
                    continue
                worst, at = max((rel(fparams[k].detach().cpu(), params[k].detach()), k) for k in params)
                check(name + f" 3 AdamW steps in float64: parameters (worst: {at})", worst, 1e-10)
                if is_moe:
                    check(name + " 3 steps in float64: balancing bias", max(rel(fbuf[k].cpu(), rbuf[k]) for k in rbuf), 1e-10)
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

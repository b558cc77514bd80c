#!/usr/bin/python3
"""Training-speed baseline: the Ladder model in PyTorch, timed on the same shapes (`ladder bench --torch`).

  bench-torch.py --config-json FILE [--impl fast|reference] [--device cpu|cuda]
                 [--precision fp32|tf32|bf16] [--compile] [--steps N] [--warmup W] [--threads T] [--seed S]

FILE holds the model fields of config.json (src/train/bench.cpp's torch_model_json: vocab_size,
d_model, n_layers, heads, head_dim, d_ff, seq_len, the MoE block and the recipe switches) plus
batch_size and, optionally, optim {lr, beta1, beta2, eps, weight_decay, clip}. Weights are random
(std 0.02, norms 1), the batch random tokens. After W warm-up steps (default 2) it times N (default 5)
whole training steps (forward, backward, gradient clipping, AdamW, and on MoE models the quantile
balancing of the selection biases) and prints one JSON line: {"tokens_per_s": <median>, "step_s":
[...], ...} ("tokens_per_s_best": the fastest step, for a noisy shared machine).

--impl fast (the default): scripts/torch_fast_model.py, the model as fast PyTorch code computes it
  (SDPA attention, MoE rows sorted by expert with grouped GEMMs, bf16 autocast under --precision
  bf16, fused AdamW on a GPU); checked against the reference by tests/reference/check_fast_model.py.
--impl reference: tests/reference/ref_model.py, the plain correctness reference (explicit attention;
  its MoE runs every expert on every token, E/K times the routed FLOPs: CPU only, dense models).
--compile: torch.compile the forward and loss (torch 2.0+; the first steps then include compilation,
  so give it warm-up steps).

Needs a python with torch: Debian's /usr/bin/python3 (torch 1.13) on the CPU; on a GPU machine the
python whose torch has CUDA (`ladder bench` takes $LADDER_TORCH_PYTHON, else python3 there).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "reference"))
sys.path.insert(0, HERE)
import ref_model as rm  # noqa: E402
import ref_moe  # noqa: E402
import torch_fast_model as fm  # noqa: E402


def init_params(cfg, device, std=0.02, seed=0):
    """Random weights made on the device (a 1.8 B-parameter preset would take minutes through
    the reference's float64 init on the host): matrices N(0, std^2), norm gains 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in rm.param_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, device=device)
        else:
            out[name] = std * torch.randn(shape, generator=g, device=device)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--impl", default="fast", choices=["fast", "reference"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "tf32", "bf16"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--moe-gemm", default="auto", choices=["auto", "grouped", "loop"])
    ap.add_argument("--gqa", default="native", choices=["native", "repeat"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"bench-torch: --device cuda, but this torch ({torch.__version__}) sees no GPU")
    if args.impl == "reference" and dev.type != "cpu":
        raise SystemExit("bench-torch: --impl reference runs on the CPU only")
    if args.precision != "fp32" and dev.type != "cuda":
        raise SystemExit(f"bench-torch: --precision {args.precision} needs --device cuda (the CPU baseline is fp32)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if dev.type == "cuda":
        tf32 = args.precision == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    bf16 = args.precision == "bf16"
    with open(args.config_json) as f:
        raw = json.load(f)
    cfg = rm.ModelConfig.from_dict(raw)
    batch = int(raw.get("batch_size", 1))
    optim = raw.get("optim", {})
    clip = optim.get("clip", 1.0)
    moe_layers = cfg.moe_layers or []
    if args.impl == "reference" and moe_layers:
        raise SystemExit("bench-torch: --impl reference on an MoE model would run every expert on every token; use --impl fast")
    balance = bool(moe_layers) and raw.get("moe_balance", False) and cfg.moe_top_k < cfg.moe_experts

    params = init_params(cfg, dev, seed=args.seed)
    for p in params.values():
        p.requires_grad_(True)
    biases = {i: torch.zeros(cfg.moe_experts, device=dev) for i in moe_layers}
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    inputs = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g, device=dev)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g, device=dev)

    if args.impl == "fast":
        moe_gemm = args.moe_gemm
        if args.compile and dev.type == "cpu" and moe_gemm == "auto":
            moe_gemm = "loop"  # torch.compile traces the grouped GEMM with its CUDA rule (bf16 only)
        model = fm.FastModel(cfg, dev, moe_gemm=moe_gemm, gqa=args.gqa)

        def forward_loss(params, inputs, targets, biases):
            aux = {}
            with fm.autocast(dev, bf16):
                logits = model.forward(params, inputs, biases, aux)
            return model.loss(logits, targets, aux), aux.get("router_scores", [])
    else:
        def forward_loss(params, inputs, targets, biases):
            return rm.loss_fn(rm.forward(params, cfg, inputs), targets, cfg.z_loss), []
    opt = fm.make_optimizer(params, optim, dev)  # torch's AdamW with the reference's decay groups
    if args.compile:
        if not hasattr(torch, "compile"):
            raise SystemExit(f"bench-torch: --compile needs torch 2.0+ (this is {torch.__version__})")
        forward_loss = torch.compile(forward_loss)

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss, scores = forward_loss(params, inputs, targets, biases)
        loss.backward()
        if balance:  # QuantileBalancer: the new selection biases from this step's router scores
            for layer, s in zip(moe_layers, scores):
                biases[layer] = fm.quantile_bias(s, biases[layer], cfg.moe_top_k)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        return loss.item()  # waits for the step's last kernel on a GPU

    t_warm = time.perf_counter()
    for _ in range(args.warmup):
        train_step()
    warmup_s = time.perf_counter() - t_warm
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step()
        times.append(time.perf_counter() - t0)

    tokens = batch * cfg.seq_len
    out = {
        "tokens_per_s": tokens / statistics.median(times),
        "tokens_per_s_best": tokens / min(times),
        "step_s": [round(t, 4) for t in times],
        "warmup_s": round(warmup_s, 2),
        "threads": args.threads,
        "tokens_per_step": tokens,
        "n_params": sum(p.numel() for p in params.values()),
        "last_loss": loss if math.isfinite(loss) else None,  # JSON has no NaN
        "torch": torch.__version__,
        "impl": args.impl,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "precision": args.precision,
        "compile": args.compile,
    }
    if args.impl == "fast":
        out["attention"] = "sdpa" if fm.HAS_SDPA else "explicit"
        out["gqa"] = "+".join(sorted(model.gqa_used)) or "none (MHA)"
        if moe_layers:
            out["moe_gemm"] = model.moe_gemm_used
    if dev.type == "cuda":
        out["peak_mem_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

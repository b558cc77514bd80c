#!/usr/bin/python3
"""CPU training-speed reference: the Ladder model in plain PyTorch (fp32).

  bench-torch.py --config-json FILE [--steps N] [--threads T] [--warmup W] [--seed S]

FILE holds the model fields of config.json (vocab_size, d_model, n_layers, n_heads, n_kv_heads,
head_dim, d_ff, seq_len, rope_theta, norm_eps, window, qk_norm, z_loss, optional rope_dims)
plus batch_size. Weights are random (std 0.02), the batch is random tokens. After W warm-up
steps (default 2) it times N (default 5) full steps (forward, backward, torch.optim.AdamW) and
prints one JSON line: {"tokens_per_s": <median>, "step_s": [...], "threads": T, ...}
("tokens_per_s_best" uses the fastest step: useful on a shared, noisy machine).

The model code is the reference in tests/reference/ref_model.py (explicit attention; torch 1.13
has no scaled_dot_product_attention). Needs a python with torch (Debian: /usr/bin/python3).
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
import ref_model as rm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with open(args.config_json) as f:
        raw = json.load(f)
    cfg = rm.ModelConfig.from_dict(raw)
    batch = int(raw.get("batch_size", 1))
    optim = raw.get("optim", {})

    params = rm.init_params(cfg, seed=args.seed, std=0.02)
    for p in params.values():
        p.requires_grad_(True)
    decay = [p for n, p in params.items() if rm.uses_weight_decay(n)]
    no_decay = [p for n, p in params.items() if not rm.uses_weight_decay(n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.get("weight_decay", 0.1)},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.get("lr", 3e-4), betas=(optim.get("beta1", 0.9), optim.get("beta2", 0.95)),
        eps=optim.get("eps", 1e-8))
    clip = optim.get("clip", 1.0)

    inputs = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))

    def train_step():
        opt.zero_grad(set_to_none=True)
        loss = rm.loss_fn(rm.forward(params, cfg, inputs), targets, cfg.z_loss)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(list(params.values()), clip)
        opt.step()
        return float(loss)

    for _ in range(args.warmup):
        train_step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = train_step()
        times.append(time.perf_counter() - t0)

    tokens = batch * cfg.seq_len
    n_params = sum(p.numel() for p in params.values())
    print(json.dumps({
        "tokens_per_s": tokens / statistics.median(times),
        "tokens_per_s_best": tokens / min(times),
        "step_s": [round(t, 4) for t in times],
        "threads": args.threads,
        "tokens_per_step": tokens,
        "n_params": n_params,
        "last_loss": loss,
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()

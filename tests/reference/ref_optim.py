#!/usr/bin/python3
"""Independent PyTorch implementation of the recipe's optimizers (RECIPE.md section 3), written
from the equations, for tests/test_optim.cpp.

  ref_optim.py --dir DIR [--dir DIR2 ...]
  ref_optim.py --selftest

Reads DIR/case.json and DIR/case.safetensors, runs the steps in float32 and writes
DIR/ref_optim.safetensors.

case.json:
  {"steps": T, "mults": [schedule multiplier of step t, ...],
   "beta1", "beta2", "eps", "muon_momentum",
   "tensors": [{"name": ..., "kind": "adamw|adam|adamh|muon|muonh", "lr": peak lr, "wd": decay}, ...]}
case.safetensors: "w.<name>" initial weights; "g.<t>.<name>" the gradient of step t (0-based).
Tensors of rank 3 are expert stacks [E, out, in]: one matrix (one sphere, one Newton-Schulz) per
expert. Linear weights are stored [out, in], so fan_out = rows and fan_in = cols.
Output: "w.<name>" final weights and the state: "exp_avg.<name>", "exp_avg_sq.<name>" (Adam
family), "momentum.<name>" (Muon family), "radius.<name>" [E or 1] (hyperball).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io as st  # noqa: E402

# RECIPE.md section 3: the per-step Newton-Schulz coefficients (a, b, c).
NS_COEFFS = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]


def newton_schulz5(d):
    """X = D/(||D||_F + 1e-8); transpose if rows > cols; 5 steps X <- a X + (b A + c A^2) X with
    A = X X^T; transpose back. Plain matrix products, nothing clever."""
    x = d / (torch.linalg.norm(d) + 1e-8)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for a, b, c in NS_COEFFS:
        A = x @ x.T
        x = a * x + (b * A + c * (A @ A)) @ x
    if tall:
        x = x.T
    return x


def hyperball(w, u, lr, R):
    """W' = W - lr R U / max(||U||_F, 1e-10); W_new = R W' / ||W'||_F."""
    wp = w - lr * R * u / max(float(torch.linalg.norm(u)), 1e-10)
    return R * wp / torch.linalg.norm(wp)


def matrices(t):
    """The matrices of a tensor: itself (2-D) or its experts (3-D)."""
    return [t] if t.dim() == 2 else [t[e] for e in range(t.shape[0])]


def run(case, tens):
    T = case["steps"]
    b1, b2, eps, mu = case["beta1"], case["beta2"], case["eps"], case["muon_momentum"]
    out = {}
    state = {}
    for spec in case["tensors"]:
        name, kind = spec["name"], spec["kind"]
        w = tens["w." + name].clone()
        m = torch.zeros_like(w)
        v = torch.zeros_like(w)
        B = torch.zeros_like(w)
        # R = ||W0||_F per matrix, computed in float64 and kept as a float32 value.
        R = [float(np.float32(torch.linalg.norm(x.double()).item())) for x in matrices(w)] if w.dim() >= 2 else []
        for t in range(T):
            g = tens[f"g.{t}.{name}"]
            lr = spec["lr"] * case["mults"][t]
            step = t + 1
            if kind in ("adamw", "adam", "adamh"):
                m = b1 * m + (1 - b1) * g
                v = b2 * v + (1 - b2) * g * g
                bc1 = 1 - b1 ** step
                bc2 = 1 - b2 ** step
                u = (m / bc1) / (torch.sqrt(v / bc2) + eps)
                if kind == "adamh":
                    w = torch.stack([hyperball(wi, ui, lr, Ri) for wi, ui, Ri in
                                     zip(matrices(w), matrices(u), R)]).reshape(w.shape)
                else:
                    if kind == "adamw":
                        w = w - lr * spec["wd"] * w
                    w = w - lr * u
            else:
                B = mu * B + g
                D = g + mu * B
                new = []
                for wi, di, k in zip(matrices(w), matrices(D), range(10 ** 6)):
                    X = newton_schulz5(di)
                    if kind == "muon":
                        rows, cols = wi.shape  # [out, in]: fan_out = rows, fan_in = cols
                        new.append(wi - lr * math.sqrt(max(1.0, rows / cols)) * X)
                    else:
                        new.append(hyperball(wi, X, lr, R[k]))
                w = torch.stack(new).reshape(w.shape)
        out["w." + name] = w
        if kind in ("adamw", "adam", "adamh"):
            state["exp_avg." + name] = m
            state["exp_avg_sq." + name] = v
        if kind in ("muon", "muonh"):
            state["momentum." + name] = B
        if kind in ("adamh", "muonh"):
            state["radius." + name] = torch.tensor(R, dtype=torch.float32)
    out.update(state)
    return out


def selftest():
    """Checks of the reference itself: the hyperball keeps the norm; Newton-Schulz output has
    singular values near 1 for a well-conditioned input; a first Adam step is lr * sign(g)."""
    torch.manual_seed(0)
    w = torch.randn(8, 5)
    R = float(torch.linalg.norm(w))
    w2 = hyperball(w, torch.randn(8, 5), 0.1, R)
    assert abs(float(torch.linalg.norm(w2)) - R) < 1e-5 * R
    x = newton_schulz5(torch.randn(16, 40, dtype=torch.float64))
    s = torch.linalg.svdvals(x)
    assert float(s.min()) > 0.97 and float(s.max()) < 1.04, s
    xt = newton_schulz5(torch.randn(40, 16, dtype=torch.float64))
    assert torch.allclose(xt.T @ xt, (xt.T @ xt).T)
    # A first Adam step: m_hat = g and v_hat = g^2, so u = g / (|g| + eps), which is sign(g) where
    # |g| >> eps and shrinks where |g| nears eps (1e-9 -> 1/11): eps inside the sqrt, or none, gives
    # other values there. AdamW first decays w by lr * wd. In float64, so rounding stays far below.
    g = torch.tensor([[0.5, -2.0, 1e-3], [-1e-4, 1e-9, -3e-8]], dtype=torch.float64)
    w0 = torch.randn(2, 3, dtype=torch.float64)
    lr, wd, eps = 0.01, 0.1, 1e-8
    for kind in ("adam", "adamw"):
        case = {"steps": 1, "mults": [1.0], "beta1": 0.9, "beta2": 0.95, "eps": eps, "muon_momentum": 0.95,
                "tensors": [{"name": "p", "kind": kind, "lr": lr, "wd": wd}]}
        out = run(case, {"w.p": w0, "g.0.p": g})
        decayed = w0 - lr * wd * w0 if kind == "adamw" else w0
        step = decayed - out["w.p"]
        large = g.abs() >= 1e-3  # eps / |g| <= 1e-5
        assert torch.allclose(step[large], lr * torch.sign(g[large]), rtol=2e-5, atol=0), (kind, step)
        assert torch.allclose(step, lr * g / (g.abs() + eps), rtol=1e-10, atol=0), (kind, step)
        assert torch.allclose(out["exp_avg.p"], 0.1 * g) and torch.allclose(out["exp_avg_sq.p"], 0.05 * g * g)
    print("ref_optim selftest ok")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", action="append", default=[])
    ap.add_argument("--selftest", action="store_true")
    a = ap.parse_args()
    if a.selftest:
        selftest()
        return
    for d in a.dir:  # several cases per call: one interpreter start for all of them
        with open(os.path.join(d, "case.json")) as f:
            case = json.load(f)
        tens, _ = st.load_torch(os.path.join(d, "case.safetensors"))
        tens = {k: v.float() for k, v in tens.items()}
        st.save_torch(os.path.join(d, "ref_optim.safetensors"), run(case, tens))


if __name__ == "__main__":
    main()

"""Ladder's model as a PyTorch user would write it for speed: the baseline of `ladder bench --torch`.

The same model, parameter names, shapes and loss as the correctness reference in tests/reference
(ref_model.py, ref_moe.py, ref_attn.py, written from RECIPE.md), but computed the way fast PyTorch
training code (torchtitan, nanoGPT-style scripts) computes it, so that a tokens/s ratio against it
says something about Ladder's kernels rather than about a deliberately plain reference:

  * attention: F.scaled_dot_product_attention (flash kernels on a GPU; GQA without copying K and V
    where the torch allows it); torch < 2.0 (Debian's 1.13) has no SDPA: explicit softmax attention;
  * MoE: no dense [tokens, E] mixing (the reference runs every expert on every token). Tokens are
    sorted by expert and the experts' GEMMs are grouped GEMMs (torch._grouped_mm, or
    F.grouped_mm) where the torch has them, else one GEMM per expert on its slice of the sorted rows;
  * mixed precision: fp32 parameters (the masters) and bf16 autocast under --precision bf16, the
    standard PyTorch recipe; the router's scores stay fp32, as Ladder's do;
  * the loss from full logits (fp32 log-sum-exp), fused AdamW where the torch has it.

tests/reference/check_fast_model.py checks it against the reference: logits, loss, every gradient,
the quantile-balancing bias and optimizer steps (CTest `TorchFast.SameModelAsTheReference`).
"""

import contextlib
import math

import torch
import torch.nn.functional as F

import ref_model as rm
import ref_moe

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
GQA_NATIVE = VERSION >= (2, 5)  # SDPA's enable_gqa
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
XSA_EPS = 1e-12  # as the reference (ref_attn.py)


def autocast_enabled(kind):
    """Is autocast on for this device type? (torch 2.4+ takes the type; older ones had a CPU call.)"""
    if VERSION >= (2, 4):
        return torch.is_autocast_enabled(kind)
    return torch.is_autocast_enabled() if kind == "cuda" else torch.is_autocast_cpu_enabled()


def autocast(device, bf16):
    """bf16 autocast on the device when bf16 is true, else autocast off there (the CPU: no context
    unless bf16, which only the reference check asks for, or autocast is on already)."""
    kind = torch.device(device).type
    if kind != "cuda" and not bf16 and not autocast_enabled(kind):
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=bf16)


def autocast_on(t):
    """Is autocast on for t's device?"""
    return autocast_enabled(t.device.type)


def rms_norm(x, w, eps):
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), None if w is None else w.to(x.dtype), eps)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


class FastModel:
    """Forward of the Ladder model on a parameter dict {HF name: tensor}. `moe_gemm`: 'grouped'
    (one grouped GEMM per expert projection), 'loop' (one GEMM per expert) or 'auto' (grouped where
    the torch has it and the operands allow it). `gqa`: 'native' (SDPA's enable_gqa) or 'repeat'."""

    def __init__(self, cfg: rm.ModelConfig, device="cpu", moe_gemm="auto", gqa="native"):
        self.cfg, self.device = cfg, torch.device(device)
        self.moe_gemm, self.gqa = moe_gemm, gqa
        self.moe_gemm_used, self.gqa_used = None, set()
        if moe_gemm == "grouped" and GROUPED_MM is None:
            raise SystemExit(f"--moe-gemm grouped: torch {torch.__version__} has no grouped GEMM")
        half = cfg.rope_dims // 2
        inv = cfg.rope_theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / cfg.rope_dims)
        ang = torch.arange(cfg.seq_len, dtype=torch.float64)[:, None] * inv[None, :]
        self.cos = torch.cos(ang).to(self.device)  # [S, rope_dims / 2], cast to the activations' type
        self.sin = torch.sin(ang).to(self.device)
        self.masks = {}

    # ------------------------------------------------------------------------------ attention
    def mask(self, S, window):
        """[S, S] bool, True where query i may see key j: j <= i and i - j < window (0: causal)."""
        if (S, window) not in self.masks:
            i = torch.arange(S, device=self.device)[:, None]
            j = torch.arange(S, device=self.device)[None, :]
            m = j <= i
            if window > 0:
                m = m & (i - j < window)
            self.masks[(S, window)] = m
        return self.masks[(S, window)]

    def rope(self, x):
        """Rotate-half RoPE on the first rope_dims dims of x [B, S, h, hd]."""
        half = self.cfg.rope_dims // 2
        c = self.cos[:, None, :].to(x.dtype)
        s = self.sin[:, None, :].to(x.dtype)
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)

    def sdpa(self, q, k, v, window):
        """q [B, H, S, hd], k and v [B, KV, S, hd] -> [B, H, S, hd]."""
        group, S = q.shape[1] // k.shape[1], q.shape[2]
        # enable_gqa only where the flash kernel takes it (on a GPU: no mask, 16-bit inputs); elsewhere
        # SDPA would pick the math kernel, an S x S matrix, so K and V are repeated instead.
        flash = not q.is_cuda or (window == 0 and q.dtype in (torch.bfloat16, torch.float16))
        native = HAS_SDPA and GQA_NATIVE and self.gqa == "native" and flash
        if group > 1:
            self.gqa_used.add("native" if native else "repeat")  # what ran, for the benchmark's report
        if group > 1 and not native:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if HAS_SDPA:
            kw = {"enable_gqa": True} if group > 1 and native else {}
            if window == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(S, window), **kw)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        return torch.softmax(scores.masked_fill(~self.mask(S, window), float("-inf")), dim=-1) @ v

    def attention(self, x, p, layer, starts):
        c = self.cfg
        B, S, _ = x.shape
        H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
        long_layer = (c.long_every > 0 and layer % c.long_every == c.long_every - 1) or \
            (c.last_layer_long and layer == c.n_layers - 1)
        q = F.linear(x, p["q_proj.weight"]).view(B, S, H, hd)
        k = F.linear(x, p["k_proj.weight"]).view(B, S, KV, hd)
        v = F.linear(x, p["v_proj.weight"]).view(B, S, KV, hd)
        if c.pko and long_layer:  # the RoPE-free half of each key: the previous token's, 0 at document starts
            half = hd // 2
            prev = F.pad(k[:, :-1, :, half:], (0, 0, 0, 0, 1, 0)).masked_fill(starts[:, :, None, None], 0.0)
            k = torch.cat([k[..., :half], prev], dim=-1)
        if c.qk_norm:
            q = rms_norm(q, p["q_norm.weight"] if c.qk_norm_gain else None, c.norm_eps)
            k = rms_norm(k, p["k_norm.weight"] if c.qk_norm_gain else None, c.norm_eps)
        q, k = self.rope(q), self.rope(k)
        if c.q_scale != 1.0:
            q = q * c.q_scale
        y = self.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0 if long_layer else c.window)
        y = y.transpose(1, 2)  # [B, S, H, hd]
        if c.xsa:  # minus each head's output component along the token's own value vector
            v_own = v.repeat_interleave(H // KV, dim=2).to(y.dtype)
            y = y - (y * v_own).sum(-1, keepdim=True) / ((v_own * v_own).sum(-1, keepdim=True) + XSA_EPS) * v_own
        if c.attn_gate:
            y = y * (2.0 * torch.sigmoid(F.linear(x, p["attn_gate.weight"])))[..., None]
        return F.linear(y.reshape(B, S, H * hd), p["o_proj.weight"])

    # ------------------------------------------------------------------------------ MLP and MoE
    @staticmethod
    def swiglu(x, wg, wu, wd):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def use_grouped(self, a, widths):
        """Grouped GEMMs for rows a of these widths? CUDA: bf16 operands (its kernels' type);
        CPU (torch 2.9+): rows of a multiple of 16 bytes."""
        if self.moe_gemm != "auto":
            return self.moe_gemm == "grouped"
        if GROUPED_MM is None:
            return False
        if a.is_cuda:
            return a.dtype == torch.bfloat16
        return VERSION >= (2, 9) and all(w * a.element_size() % 16 == 0 for w in widths)

    def experts(self, xs, ends, wg, wu, wd):
        """xs [T*K, d] sorted by expert, ends [E] (int32: expert e's rows end at ends[e]) -> SwiGLU_e of
        each row [T*K, d]."""
        if autocast_on(xs):  # autocast (bf16: the only one used here) does not cover grouped GEMMs
            dt = torch.bfloat16
            xs, wg, wu, wd = xs.to(dt), wg.to(dt), wu.to(dt), wd.to(dt)
        grouped = self.use_grouped(xs, (xs.shape[1], wd.shape[2]))
        self.moe_gemm_used = "grouped" if grouped else "loop"  # what ran, for the benchmark's report
        if grouped:
            # weights [E, out, in]: the [E, in, out] operand of x @ W^T is the transposed view
            mid = F.silu(GROUPED_MM(xs, wg.transpose(-2, -1), offs=ends)) * GROUPED_MM(xs, wu.transpose(-2, -1), offs=ends)
            return GROUPED_MM(mid, wd.transpose(-2, -1), offs=ends)
        counts = torch.diff(ends.long(), prepend=ends.new_zeros(1).long()).tolist()  # the host needs the sizes
        outs = [self.swiglu(xe, wg[e], wu[e], wd[e]) for e, xe in enumerate(torch.split(xs, counts))]
        return torch.cat(outs)

    def moe(self, x, p, bias, aux):
        c = self.cfg
        B, S, d = x.shape
        E, K = c.moe_experts, c.moe_top_k
        t = x.reshape(B * S, d)
        acc = torch.promote_types(t.dtype, torch.float32)  # fp32 (fp64 in the reference check)
        with autocast(t.device, False):  # the router in fp32
            s = F.linear(t.to(acc), p["gate.weight"].to(acc))  # [T, E]
        sel = torch.topk(s.detach() + bias, K, dim=-1).indices  # [T, K]
        w = torch.sigmoid(s).gather(1, sel)
        if c.moe_normalized:
            w = c.moe_route_scale * w / (w.sum(-1, keepdim=True) + 1e-9)
        flat = sel.reshape(-1)
        by_expert, order = torch.sort(flat, stable=True)  # rows grouped by expert
        tok = order // K
        # where each expert's rows end, found on the device (bincount would wait for the host)
        ends = torch.searchsorted(by_expert, torch.arange(E, device=t.device), right=True).to(torch.int32)
        src = t.to(torch.bfloat16) if autocast_on(t) else t  # gather the rows in the GEMMs' type
        h = self.experts(src[tok], ends, p["experts.gate_proj.weight"], p["experts.up_proj.weight"],
                         p["experts.down_proj.weight"])
        out = torch.zeros(t.shape, dtype=acc, device=t.device)
        out = out.index_add(0, tok, h.to(acc) * w.reshape(-1)[order, None])
        if c.moe_shared_ff > 0:
            out = out + self.swiglu(t, p["shared_expert.gate_proj.weight"], p["shared_expert.up_proj.weight"],
                                    p["shared_expert.down_proj.weight"])
        aux.setdefault("router_scores", []).append(s.detach())
        aux.setdefault("router_lse_sq", []).append(torch.logsumexp(s, dim=-1).pow(2).mean())
        return out.reshape(B, S, d)

    # ------------------------------------------------------------------------------ the model
    def norm(self, x, params, name):
        n = rms_norm(x, params[name + ".weight"], self.cfg.norm_eps)
        if self.cfg.gated_norm_rank <= 0:
            return n
        hid = F.silu(F.linear(n, params[name + ".gated_norm.down_proj.weight"]))
        return n * torch.sigmoid(F.linear(hid, params[name + ".gated_norm.up_proj.weight"]))

    def forward(self, params, inputs, biases, aux):
        """inputs [B, S] -> logits [B, S, V]; biases {layer: selection bias [E]}; aux collects the
        router scores and lse^2 terms."""
        c = self.cfg
        starts = None
        if c.pko:
            starts = torch.zeros(inputs.shape, dtype=torch.bool, device=inputs.device)
            starts[:, 0] = True
            starts[:, 1:] = inputs[:, :-1] == c.eod_id
        x = F.embedding(inputs, params["model.embed_tokens.weight"])
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            sub = {k[len(p) + len("self_attn."):]: v for k, v in params.items() if k.startswith(p + "self_attn.")}
            x = x + self.attention(self.norm(x, params, p + "input_layernorm"), sub, i, starts)
            m = self.norm(x, params, p + "post_attention_layernorm")
            if ref_moe.is_moe_layer(c, i):
                sub = {k[len(p) + 4:]: v for k, v in params.items() if k.startswith(p + "mlp.")}
                x = x + self.moe(m, sub, biases[i], aux)
            else:
                x = x + self.swiglu(m, params[p + "mlp.gate_proj.weight"], params[p + "mlp.up_proj.weight"],
                                    params[p + "mlp.down_proj.weight"])
        return F.linear(self.norm(x, params, "model.norm"), params["lm_head.weight"])

    def loss(self, logits, targets, aux):
        """Mean cross-entropy + z_loss * mean(lse^2) + router_z_loss * mean over MoE layers of
        mean(lse(router scores)^2), from fp32 logits."""
        c = self.cfg
        lf = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, logits.shape[-1])
        lse = torch.logsumexp(lf, dim=-1)
        loss = (lse - lf.gather(1, targets.reshape(-1, 1)).squeeze(1)).mean()
        if c.z_loss:
            loss = loss + c.z_loss * lse.pow(2).mean()
        if c.router_z_loss and aux.get("router_lse_sq"):
            loss = loss + c.router_z_loss * torch.stack(aux["router_lse_sq"]).mean()
        return loss


@torch.no_grad()
def quantile_bias(scores, bias, K):
    """QuantileBalancer's new selection bias from one step's router scores [T, E]: alpha_i = the
    (K+1)-th largest biased score of token i; beta_j = the max(1, floor(T*K/E))-th largest of
    s_ij - alpha_i over tokens; bias = -(beta - mean(beta))."""
    T, E = scores.shape
    alpha = torch.topk(scores + bias, K + 1, dim=-1).values[:, K]
    q = max(1, (T * K) // E)
    beta = torch.topk(scores - alpha[:, None], q, dim=0).values[q - 1]
    return -(beta - beta.mean())


def make_optimizer(params, optim, device):
    """torch.optim.AdamW with the reference's decay groups (ref_model.uses_weight_decay); fused on a
    GPU where the torch has it (2.0+), foreach otherwise."""
    decay = [p for n, p in params.items() if rm.uses_weight_decay(n)]
    no_decay = [p for n, p in params.items() if not rm.uses_weight_decay(n)]
    kw = {}
    if VERSION >= (2, 0) and torch.device(device).type == "cuda":
        kw["fused"] = True
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": optim.get("weight_decay", 0.1)},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=optim.get("lr", 3e-4), betas=(optim.get("beta1", 0.9), optim.get("beta2", 0.95)),
        eps=optim.get("eps", 1e-8), **kw)

"""Independent plain-PyTorch reference of the Ladder model, loss, AdamW and LR schedule.

Written from the specification (tests/reference/README.md), not from the C++ code.
Parameters are held in a plain dict {HF tensor name: tensor}; every layer is one
function so each step of the math can be read (and compared) on its own.

Conventions worth knowing when comparing against the C++ side:
  * Linear weights are [out_features, in_features]; y = x @ W.T.
  * RoPE angles are computed in float64 and cast to the working dtype.
  * Attention is explicit: scores = q k^T / sqrt(hd), masked with -inf, softmax, @ v.
  * The global gradient norm is accumulated in float64.
  * AdamW bias corrections use t = number of updates done including this one (1-based).
"""

import math
from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch

import ref_moe
import ref_attn as ra

Params = Dict[str, torch.Tensor]


# ----------------------------------------------------------------------------- config

@dataclass
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    window: int = 0              # 0 = full causal; else query i sees keys j with 0 <= i-j < window
    qk_norm: bool = False
    z_loss: float = 0.0
    rope_dims: Optional[int] = None  # None -> head_dim (full RoPE); head_dim//2 = half RoPE
    # MoE V1 block (ref_moe.py); moe_experts = 0: dense MLPs
    moe_experts: int = 0
    moe_top_k: int = 0
    moe_expert_ff: int = 0
    moe_shared_ff: int = 0
    moe_layers: Optional[list] = None
    moe_normalized: bool = False
    moe_route_scale: float = 1.0
    router_z_loss: float = 0.0
    # attention/norm recipe switches: see ref_attn.py
    qk_norm_gain: bool = True
    q_scale: float = 1.0
    long_every: int = 0
    last_layer_long: bool = False
    pko: bool = False
    eod_id: int = -1
    xsa: bool = False
    attn_gate: bool = False
    gated_norm_rank: int = 0

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in d.items() if k in names})
        cfg.qk_norm = bool(cfg.qk_norm)
        cfg.window = int(cfg.window or 0)
        cfg.z_loss = float(cfg.z_loss or 0.0)
        cfg.qk_norm_gain, cfg.pko = bool(cfg.qk_norm_gain), bool(cfg.pko)
        cfg.last_layer_long, cfg.xsa, cfg.attn_gate = bool(cfg.last_layer_long), bool(cfg.xsa), bool(cfg.attn_gate)
        if cfg.pko:
            assert cfg.eod_id >= 0, "pko needs eod_id (document starts)"
            assert cfg.rope_dims == cfg.head_dim // 2, "pko shifts the RoPE-free half: needs half-RoPE"
        if cfg.rope_dims is None or cfg.rope_dims == 0:
            cfg.rope_dims = cfg.head_dim
        assert cfg.n_heads % cfg.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads"
        assert cfg.rope_dims % 2 == 0 and cfg.rope_dims <= cfg.head_dim
        return cfg


@dataclass
class OptimConfig:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip: float = 0.0
    warmup: int = 0
    total_steps: int = 0
    final_lr_frac: float = 0.0

    @classmethod
    def from_dict(cls, d):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# ----------------------------------------------------------------------------- parameters

def param_shapes(cfg: ModelConfig):
    """Ordered {name: shape} of every parameter (HF naming)."""
    d, hd, H, KV, I, V = cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (V, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (H * hd, d)
        shapes[p + "self_attn.k_proj.weight"] = (KV * hd, d)
        shapes[p + "self_attn.v_proj.weight"] = (KV * hd, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, H * hd)
        shapes.update(ra.extra_shapes(cfg, i))
        if cfg.qk_norm and cfg.qk_norm_gain:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if ref_moe.is_moe_layer(cfg, i):
            shapes.update(ref_moe.moe_param_shapes(cfg, p + "mlp."))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (I, d)
        shapes[p + "mlp.up_proj.weight"] = (I, d)
        shapes[p + "mlp.down_proj.weight"] = (d, I)
    shapes["model.norm.weight"] = (d,)
    shapes.update(ra.extra_shapes(cfg, None))
    shapes["lm_head.weight"] = (V, d)
    return shapes


def init_params(cfg: ModelConfig, seed=0, std=0.02, norm_jitter=0.0, dtype=torch.float32) -> Params:
    """Random init: matrices ~ N(0, std^2); norm weights = 1 (+ optional N(0, norm_jitter^2))."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.float64)
            if norm_jitter:
                t += norm_jitter * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            t = std * torch.randn(shape, generator=g, dtype=torch.float64)
        params[name] = t.to(dtype)
    return params


def check_params(cfg: ModelConfig, params: Params):
    want = param_shapes(cfg)
    missing = [k for k in want if k not in params]
    extra = [k for k in params if k not in want]
    if missing or extra:
        raise ValueError(f"parameter mismatch: missing={missing} unexpected={extra}")
    for k, s in want.items():
        if tuple(params[k].shape) != tuple(s):
            raise ValueError(f"{k}: shape {tuple(params[k].shape)} != expected {s}")


# ----------------------------------------------------------------------------- layers

def linear(x, weight):
    """y = x @ W^T with W stored [out_features, in_features]."""
    return x @ weight.t()


def rms_norm(x, weight, eps):
    """x / sqrt(mean(x^2 over last dim) + eps) * weight."""
    return x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight


def rope_cos_sin(seq_len, rope_dims, theta, dtype):
    """cos/sin tables [seq_len, rope_dims/2]; angle = p * theta^(-2i/rope_dims), in float64."""
    half = rope_dims // 2
    i = torch.arange(half, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / rope_dims)
    pos = torch.arange(seq_len, dtype=torch.float64)
    angle = pos[:, None] * inv_freq[None, :]
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def apply_rope(x, cos, sin, rope_dims):
    """Rotate-half RoPE on x [B, S, n_heads, hd]; only the first rope_dims dims rotate,
    pairs (i, i + rope_dims/2):  x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin."""
    half = rope_dims // 2
    x1 = x[..., :half]
    x2 = x[..., half:rope_dims]
    rest = x[..., rope_dims:]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


def attention_mask(seq_len, window, device=None):
    """Boolean [S, S], True where query i may attend key j: j <= i and (window == 0 or i - j < window)."""
    i = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(seq_len, device=device)[None, :]
    allowed = j <= i
    if window > 0:
        allowed = allowed & (i - j < window)
    return allowed


def attention(x, params: Params, prefix, cfg: ModelConfig, cos, sin, mask):
    """Grouped-query self-attention with optional QK-norm and RoPE. x: [B, S, d]."""
    B, S, _ = x.shape
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = linear(x, params[prefix + "q_proj.weight"]).view(B, S, H, hd)
    k = linear(x, params[prefix + "k_proj.weight"]).view(B, S, KV, hd)
    v = linear(x, params[prefix + "v_proj.weight"]).view(B, S, KV, hd)
    if cfg.qk_norm:
        q = rms_norm(q, params[prefix + "q_norm.weight"], cfg.norm_eps)
        k = rms_norm(k, params[prefix + "k_norm.weight"], cfg.norm_eps)
    q = apply_rope(q, cos, sin, cfg.rope_dims)
    k = apply_rope(k, cos, sin, cfg.rope_dims)
    # GQA: query head h reads kv head h // (H / KV); repeat_interleave gives exactly that order.
    group = H // KV
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))          # [B, H, S, hd]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)         # [B, H, S, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = probs @ v                                            # [B, H, S, hd]
    out = out.transpose(1, 2).reshape(B, S, H * hd)
    return linear(out, params[prefix + "o_proj.weight"])


def mlp(x, params: Params, prefix):
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = linear(x, params[prefix + "gate_proj.weight"])
    up = linear(x, params[prefix + "up_proj.weight"])
    return linear(torch.nn.functional.silu(gate) * up, params[prefix + "down_proj.weight"])


def block(x, params: Params, layer, cfg: ModelConfig, cos, sin, mask, inputs=None, buffers=None, aux=None):
    """Pre-norm decoder block: h = x + Attn(RMSNorm(x)); out = h + MLP(RMSNorm(h)).
    (RMSNorm includes GatedNorm and Attn the recipe switches when configured: ref_attn.py; the MLP
    is the MoE block on MoE layers: ref_moe.py.)"""
    p = f"model.layers.{layer}."
    a_in = ra.norm(x, params, p + "input_layernorm", cfg)
    if ra.enabled(cfg):
        h = x + ra.attention(a_in, params, p + "self_attn.", cfg, layer, inputs, cos, sin)
    else:
        h = x + attention(a_in, params, p + "self_attn.", cfg, cos, sin, mask)
    m_in = ra.norm(h, params, p + "post_attention_layernorm", cfg)
    if ref_moe.is_moe_layer(cfg, layer):
        return h + ref_moe.moe_mlp(m_in, params, p + "mlp.", cfg, buffers[p + "mlp." + ref_moe.BIAS], aux)
    return h + mlp(m_in, params, p + "mlp.")


def forward(params: Params, cfg: ModelConfig, inputs, buffers=None, aux=None):
    """inputs: int64 [B, S] token ids -> logits [B, S, V]. MoE models need `buffers` (the selection
    biases); `aux` (a dict) collects router scores and z-loss terms (ref_moe.py)."""
    B, S = inputs.shape
    dtype = params["model.embed_tokens.weight"].dtype
    x = params["model.embed_tokens.weight"][inputs]            # [B, S, d]
    cos, sin = rope_cos_sin(S, cfg.rope_dims, cfg.rope_theta, dtype)
    mask = attention_mask(S, cfg.window)
    for layer in range(cfg.n_layers):
        x = block(x, params, layer, cfg, cos, sin, mask, inputs, buffers, aux)
    x = ra.norm(x, params, "model.norm", cfg)
    return linear(x, params["lm_head.weight"])


def loss_fn(logits, targets, z_loss=0.0):
    """mean cross-entropy over all B*S tokens + z_loss * mean(logsumexp(logits)^2)."""
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    t = targets.reshape(-1)
    lse = torch.logsumexp(flat, dim=-1)
    ce = lse - flat.gather(1, t[:, None]).squeeze(1)
    loss = ce.mean()
    if z_loss:
        loss = loss + z_loss * lse.pow(2).mean()
    return loss


# ----------------------------------------------------------------------------- optimizer

def lr_at(step, oc: OptimConfig):
    """LR for 0-based step: linear warmup lr*(t+1)/warmup, then linear decay to lr*final_lr_frac."""
    if step < oc.warmup:
        return oc.lr * (step + 1) / oc.warmup
    progress = (step - oc.warmup) / max(1, oc.total_steps - oc.warmup)
    return oc.lr * (oc.final_lr_frac + (1.0 - oc.final_lr_frac) * (1.0 - progress))


def uses_weight_decay(name):
    """Decay group: every '*proj.weight' matrix and lm_head; norms and embeddings are not decayed."""
    return name.endswith("proj.weight") or name == "lm_head.weight"


def global_grad_norm(grads: Params):
    """sqrt(sum of squares of every gradient element), accumulated in float64. Returns a float."""
    total = 0.0
    for g in grads.values():
        total += float(g.double().pow(2).sum())
    return math.sqrt(total)


def clip_grads(grads: Params, clip):
    """Global-norm clipping in place. Returns the norm measured before clipping."""
    total = global_grad_norm(grads)
    if clip > 0 and total > clip:
        scale = clip / (total + 1e-6)
        for g in grads.values():
            g.mul_(scale)
    return total


class AdamW:
    """AdamW written out from the equations (decoupled weight decay, bias-corrected moments)."""

    def __init__(self, params: Params, oc: OptimConfig):
        self.oc = oc
        self.t = 0
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}

    @torch.no_grad()
    def step(self, params: Params, grads: Params, lr):
        oc = self.oc
        self.t += 1
        bc1 = 1.0 - oc.beta1 ** self.t
        bc2 = 1.0 - oc.beta2 ** self.t
        for name, p in params.items():
            g = grads[name]
            m, v = self.m[name], self.v[name]
            m.copy_(oc.beta1 * m + (1.0 - oc.beta1) * g)
            v.copy_(oc.beta2 * v + (1.0 - oc.beta2) * g * g)
            if oc.weight_decay and uses_weight_decay(name):
                p.copy_(p - lr * oc.weight_decay * p)
            m_hat = m / bc1
            v_hat = v / bc2
            p.copy_(p - lr * m_hat / (torch.sqrt(v_hat) + oc.eps))

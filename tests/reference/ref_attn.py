"""Attention and norm recipe switches of the PyTorch reference, written from RECIPE.md section 2
("V1 attention extras", "Rung: PKO"), not from the C++ code.

Switches (config.json keys; all off/neutral by default, see ref_model.ModelConfig):
  rope_dims        head_dim // 2 = half-RoPE (dims [0, hd/2) rotate, [hd/2, hd) carry no position)
  qk_norm_gain     False: QK-norm is a plain RMSNorm (no learned gain)
  q_scale          q *= q_scale after QK-norm and RoPE (recipe 1.3)
  long_every       > 0: layer i is long (full causal) iff i % long_every == long_every - 1;
                   the other (short) layers use the sliding window `window`
  last_layer_long  the last layer is long too
  pko              partial key offset on long layers
  eod_id           end-of-document token: the token after it starts a document
  xsa              exclusive self attention
  attn_gate        per-head output gate 2*sigmoid(h W_g), h = the attention sublayer's input
  gated_norm_rank  > 0: GatedNorm n * sigmoid(W_up silu(W_down n)) after every d-wide RMSNorm

Order inside attention (RECIPE.md, PKO rung): PKO shift of the raw keys (long layers) ->
QK-norm -> RoPE -> q *= q_scale -> softmax attention -> XSA -> gate -> o_proj.
"""

import math

import torch

import ref_model as rm

XSA_EPS = 1e-12  # ||v||^2 + XSA_EPS: keeps an all-zero value vector finite; negligible otherwise


def enabled(cfg):
    """True when any attention switch differs from the dense baseline (then attention() is used)."""
    return (cfg.rope_dims != cfg.head_dim or not cfg.qk_norm_gain or cfg.q_scale != 1.0
            or cfg.long_every > 0 or cfg.last_layer_long or cfg.pko or cfg.xsa or cfg.attn_gate)


def is_long(cfg, layer):
    periodic = cfg.long_every > 0 and layer % cfg.long_every == cfg.long_every - 1
    return periodic or (cfg.last_layer_long and layer == cfg.n_layers - 1)


def extra_shapes(cfg, layer):
    """Parameters the switches add to one layer (layer=None: the final norm's)."""
    d, r, out = cfg.d_model, cfg.gated_norm_rank, {}
    norms = ["model.norm"] if layer is None else [f"model.layers.{layer}.input_layernorm",
                                                  f"model.layers.{layer}.post_attention_layernorm"]
    if r > 0:
        for n in norms:
            out[n + ".gated_norm.down_proj.weight"] = (r, d)
            out[n + ".gated_norm.up_proj.weight"] = (d, r)
    if layer is not None and cfg.attn_gate:
        out[f"model.layers.{layer}.self_attn.attn_gate.weight"] = (cfg.n_heads, d)
    return out


def norm(x, params, name, cfg):
    """RMSNorm with the learned gain `name`.weight, then GatedNorm when gated_norm_rank > 0."""
    n = rm.rms_norm(x, params[name + ".weight"], cfg.norm_eps)
    if cfg.gated_norm_rank <= 0:
        return n
    hidden = torch.nn.functional.silu(rm.linear(n, params[name + ".gated_norm.down_proj.weight"]))
    return n * torch.sigmoid(rm.linear(hidden, params[name + ".gated_norm.up_proj.weight"]))


def document_starts(inputs, eod_id):
    """[B, S] bool: position 0 of every row, and every token right after an end-of-document token."""
    starts = torch.zeros(inputs.shape, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = inputs[:, :-1] == eod_id
    return starts


def partial_key_offset(k, inputs, eod_id):
    """k [B, S, KV, hd]: the second half of every head's dims becomes the previous token's, zero at
    document starts (and position 0)."""
    half = k.shape[-1] // 2
    prev = torch.zeros_like(k[..., half:])
    prev[:, 1:] = k[:, :-1, :, half:]
    prev = prev.masked_fill(document_starts(inputs, eod_id)[:, :, None, None], 0.0)
    return torch.cat([k[..., :half], prev], dim=-1)


def attention(x, params, prefix, cfg, layer, inputs, cos, sin):
    """The attention sublayer with the switches. x [B, S, d] (the normed hidden)."""
    B, S, _ = x.shape
    H, KV, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    long_layer = is_long(cfg, layer)
    q = rm.linear(x, params[prefix + "q_proj.weight"]).view(B, S, H, hd)
    k = rm.linear(x, params[prefix + "k_proj.weight"]).view(B, S, KV, hd)
    v = rm.linear(x, params[prefix + "v_proj.weight"]).view(B, S, KV, hd)
    if cfg.pko and long_layer:
        k = partial_key_offset(k, inputs, cfg.eod_id)
    if cfg.qk_norm:
        one = torch.ones(hd, dtype=x.dtype)
        q = rm.rms_norm(q, params[prefix + "q_norm.weight"] if cfg.qk_norm_gain else one, cfg.norm_eps)
        k = rm.rms_norm(k, params[prefix + "k_norm.weight"] if cfg.qk_norm_gain else one, cfg.norm_eps)
    q = rm.apply_rope(q, cos, sin, cfg.rope_dims)
    k = rm.apply_rope(k, cos, sin, cfg.rope_dims)
    q = q * cfg.q_scale
    group = H // KV
    v_own = v.repeat_interleave(group, dim=2)                 # [B, S, H, hd]: each head's value
    kh = k.repeat_interleave(group, dim=2).transpose(1, 2)    # [B, H, S, hd]
    qh = q.transpose(1, 2)
    scores = (qh @ kh.transpose(-1, -2)) / math.sqrt(hd)
    mask = rm.attention_mask(S, 0 if long_layer else cfg.window)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    y = (probs @ v_own.transpose(1, 2)).transpose(1, 2)       # [B, S, H, hd]
    if cfg.xsa:
        # remove the component of each head's output along the token's own value vector
        coef = (y * v_own).sum(-1, keepdim=True) / ((v_own * v_own).sum(-1, keepdim=True) + XSA_EPS)
        y = y - coef * v_own
    if cfg.attn_gate:
        gate = 2.0 * torch.sigmoid(rm.linear(x, params[prefix + "attn_gate.weight"]))  # [B, S, H]
        y = y * gate[..., None]
    return rm.linear(y.reshape(B, S, H * hd), params[prefix + "o_proj.weight"])

"""Independent plain-PyTorch reference of the MoE V1 block (RECIPE.md section 2).

Written from the recipe, not from the C++ code, and deliberately computed differently:
no sort, no dispatch. Every expert runs on every token and a dense [tokens, E] matrix of
combine weights (zero where an expert is not selected) mixes the results. Autograd provides
every gradient, the router's included.

  router scores   s = x @ W_r^T                                  [T, E]
  selection       top-K of (s + bias), bias without gradient; ties -> lower expert index
  combine weight  sigmoid(s_e)                       (V1)
                  f * sigmoid(s_e) / (sum_topK sigmoid + 1e-9)  (normalized)
  output          sum_{e in topK} w_e SwiGLU_e(x) + SwiGLU_shared(x)
  router z-loss   mean over tokens of logsumexp(s)^2 (the model averages it over MoE layers)
  balancing       alpha_i = (K+1)-th largest biased score; beta_j = the max(1, floor(T*K/E))-th
                  largest of (s_ij - alpha_i) over tokens; new bias = -(beta - mean(beta))

Tensor names (the C++ side's safetensors layout):
  model.layers.N.mlp.gate.weight [E, d]; model.layers.N.mlp.gate.e_score_correction_bias [E]
  model.layers.N.mlp.experts.{gate,up}_proj.weight [E, I, d]; experts.down_proj.weight [E, d, I]
  model.layers.N.mlp.shared_expert.{gate,up}_proj.weight [I_s, d]; shared_expert.down_proj.weight [d, I_s]
"""

import torch

BIAS = "gate.e_score_correction_bias"


def is_moe_layer(cfg, layer):
    return cfg.moe_experts > 0 and layer in (cfg.moe_layers or [])


def moe_param_shapes(cfg, prefix):
    """{name: shape} of one MoE block's trained tensors (prefix = 'model.layers.N.mlp.')."""
    d, E, I, Is = cfg.d_model, cfg.moe_experts, cfg.moe_expert_ff, cfg.moe_shared_ff
    shapes = {prefix + "gate.weight": (E, d),
              prefix + "experts.gate_proj.weight": (E, I, d),
              prefix + "experts.up_proj.weight": (E, I, d),
              prefix + "experts.down_proj.weight": (E, d, I)}
    if Is > 0:
        shapes[prefix + "shared_expert.gate_proj.weight"] = (Is, d)
        shapes[prefix + "shared_expert.up_proj.weight"] = (Is, d)
        shapes[prefix + "shared_expert.down_proj.weight"] = (d, Is)
    return shapes


def swiglu(x, wg, wu, wd):
    return (torch.nn.functional.silu(x @ wg.t()) * (x @ wu.t())) @ wd.t()


def select_top_k(scores_biased, K):
    """Indices [T, K] of the K largest entries per row, lower index first among equals
    (a stable descending sort keeps equal entries in index order)."""
    order = torch.sort(scores_biased, dim=-1, descending=True, stable=True).indices
    return order[:, :K]


def moe_mlp(x, params, prefix, cfg, bias, aux=None):
    """x [B, S, d] -> [B, S, d]. Appends the router scores and mean lse^2 to aux (if given)."""
    B, S, d = x.shape
    E, K = cfg.moe_experts, cfg.moe_top_k
    t = x.reshape(B * S, d)
    s = t @ params[prefix + "gate.weight"].t()                     # [T, E]
    sel = select_top_k((s + bias.to(s.dtype)).detach(), K)        # no gradient through selection
    sig = torch.sigmoid(s)
    picked = sig.gather(1, sel)                                    # [T, K]
    if cfg.moe_normalized:
        picked = cfg.moe_route_scale * picked / (picked.sum(dim=-1, keepdim=True) + 1e-9)
    weights = torch.zeros_like(s).scatter(1, sel, picked)          # [T, E], zero if not selected
    out = torch.zeros_like(t)
    for e in range(E):
        y = swiglu(t, params[prefix + "experts.gate_proj.weight"][e],
                   params[prefix + "experts.up_proj.weight"][e],
                   params[prefix + "experts.down_proj.weight"][e])
        out = out + weights[:, e:e + 1] * y
    if cfg.moe_shared_ff > 0:
        out = out + swiglu(t, params[prefix + "shared_expert.gate_proj.weight"],
                           params[prefix + "shared_expert.up_proj.weight"],
                           params[prefix + "shared_expert.down_proj.weight"])
    if aux is not None:
        aux.setdefault("router_scores", []).append(s.detach())
        aux.setdefault("router_lse_sq", []).append(torch.logsumexp(s, dim=-1).pow(2).mean())
    return out.reshape(B, S, d)


def router_z_loss(cfg, aux):
    """router_z_loss * mean over MoE layers of mean_tokens(logsumexp(s)^2)."""
    terms = aux.get("router_lse_sq", [])
    if not cfg.router_z_loss or not terms:
        return 0.0
    return cfg.router_z_loss * torch.stack(terms).mean()


@torch.no_grad()
def quantile_bias(scores, bias, K):
    """New selection bias from the unbiased router scores [T, E] of one step's tokens."""
    T, E = scores.shape
    biased = scores + bias
    alpha = torch.sort(biased, dim=-1, descending=True).values[:, K]   # (K+1)-th largest
    vals = scores - alpha[:, None]
    q = max(1, (T * K) // E)
    beta = torch.sort(vals, dim=0, descending=True).values[q - 1]      # q-th largest per expert
    return -(beta - beta.mean())

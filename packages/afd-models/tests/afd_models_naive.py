"""An independent, deliberately naive reference: per token, per head, per selected expert.

It shares no code with afd_models beyond reading the same weights by their Hugging Face
names. Everything runs in float64 with Python loops and scalar formulas, written from
the DeepSeek-V2/V3 reference semantics, so a mistake in the batched implementation (a
wrong mask, a wrong group score, a scaling applied twice, a causal leak across requests)
shows up as a mismatch instead of being reproduced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from afd_models import DeepseekConfig

Weights = Mapping[str, torch.Tensor]


def w64(weights: Weights, name: str) -> torch.Tensor:
    return weights[name].detach().to("cpu", torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One vector."""
    return weight * x / math.sqrt(float((x * x).mean()) + eps)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def mlp(weights: Weights, prefix: str, x: torch.Tensor) -> torch.Tensor:
    """One token through a gated MLP."""
    gate = w64(weights, f"{prefix}gate_proj.weight") @ x
    up = w64(weights, f"{prefix}up_proj.weight") @ x
    return w64(weights, f"{prefix}down_proj.weight") @ (silu(gate) * up)


# ---- router ------------------------------------------------------------------------


def token_scores(config: DeepseekConfig, gate: torch.Tensor, x: torch.Tensor) -> list[float]:
    """Every expert's unbiased score for one token (softmax or sigmoid of the logits)."""
    logits = [float(gate[e].double() @ x.double()) for e in range(config.n_routed_experts)]
    if config.scoring_func == "softmax":
        top = max(logits)
        exps = [math.exp(v - top) for v in logits]
        return [v / sum(exps) for v in exps]
    return [1.0 / (1.0 + math.exp(-v)) for v in logits]


def token_weights(
    config: DeepseekConfig, gate: torch.Tensor, x: torch.Tensor, experts: Sequence[int]
) -> list[float]:
    """The router's weights for one token routed to ``experts`` (any of them, chosen or
    not): their scores, renormalised when ``norm_topk_prob``, before routed_scaling_factor."""
    scores = token_scores(config, gate, x)
    weights = [scores[e] for e in experts]
    if config.norm_topk_prob:
        total = sum(weights)
        weights = [w / total for w in weights]
    return weights


def route_token(
    config: DeepseekConfig, gate: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor
) -> dict[int, float]:
    """``{expert: weight}`` for one token (weights before routed_scaling_factor)."""
    experts = config.n_routed_experts
    scores = token_scores(config, gate, x)
    choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
    candidates = list(range(experts))
    if config.topk_method in ("group_limited_greedy", "noaux_tc"):
        size = experts // config.n_group
        group_score = []
        for g in range(config.n_group):
            members = sorted(choice[g * size : (g + 1) * size], reverse=True)
            if config.topk_method == "noaux_tc":
                group_score.append(members[0] + members[1])
            else:
                group_score.append(members[0])
        kept = sorted(range(config.n_group), key=lambda g: -group_score[g])[: config.topk_group]
        candidates = [e for e in range(experts) if e // size in kept]
    chosen = sorted(candidates, key=lambda e: -choice[e])[: config.num_experts_per_tok]
    weights = {e: scores[e] for e in chosen}
    if config.norm_topk_prob:
        total = sum(weights.values())
        weights = {e: w / total for e, w in weights.items()}
    return weights


def moe_token(
    config: DeepseekConfig, weights: Weights, layer: int, x: torch.Tensor
) -> torch.Tensor:
    """One token through MoE layer ``layer``: the true (unscaled-for-fp16) output."""
    p = f"model.layers.{layer}.mlp."
    bias_name = f"{p}gate.e_score_correction_bias"
    bias = w64(weights, bias_name) if bias_name in weights else None
    routing = route_token(config, w64(weights, f"{p}gate.weight"), bias, x)
    out = torch.zeros_like(x)
    for expert, weight in routing.items():
        out += config.routed_scaling_factor * weight * mlp(weights, f"{p}experts.{expert}.", x)
    if config.n_shared_experts:
        out += mlp(weights, f"{p}shared_experts.", x)
    return out


def moe(config: DeepseekConfig, weights: Weights, layer: int, x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return torch.stack([moe_token(config, weights, layer, x[t]) for t in range(x.shape[0])])


# ---- rotary and attention ----------------------------------------------------------


def inverse_frequency(config: DeepseekConfig, i: int) -> float:
    """Frequency of rotary pair ``i`` (YaRN blend of the original and interpolated ones)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    original = base ** (-2.0 * i / dim)
    rope = config.rope_scaling
    if rope is None:
        return original

    def correction_dim(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    width = high - low if high != low else 0.001
    ramp = min(max((i - low) / width, 0.0), 1.0)  # 0: keep original, 1: interpolate
    return (original / rope.factor) * ramp + original * (1.0 - ramp)


def mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rotate(config: DeepseekConfig, v: torch.Tensor, position: int) -> torch.Tensor:
    """Rotate one rope vector (interleaved pairs) at ``position``."""
    rope = config.rope_scaling
    scale = (
        1.0
        if rope is None
        else mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    )
    out = torch.empty_like(v)
    for i in range(v.shape[0] // 2):
        angle = position * inverse_frequency(config, i)
        c, s = math.cos(angle) * scale, math.sin(angle) * scale
        a, b = float(v[2 * i]), float(v[2 * i + 1])
        out[2 * i], out[2 * i + 1] = a * c - b * s, b * c + a * s
    return out


def attention_request(
    config: DeepseekConfig, weights: Weights, layer: int, x: torch.Tensor
) -> torch.Tensor:
    """MLA over one request ``x [L, H]`` (its own tokens only, causal)."""
    c = config
    a = f"model.layers.{layer}.self_attn."
    heads, nope, rope, vdim = (
        c.num_attention_heads,
        c.qk_nope_head_dim,
        c.qk_rope_head_dim,
        c.v_head_dim,
    )
    qk = nope + rope
    scale = qk**-0.5
    if c.rope_scaling is not None and c.rope_scaling.mscale_all_dim:
        scale *= mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim) ** 2
    length = x.shape[0]
    queries, keys, values = [], [], []
    for t in range(length):
        if c.q_lora_rank is None:
            q = w64(weights, f"{a}q_proj.weight") @ x[t]
        else:
            qa = rms_norm(
                w64(weights, f"{a}q_a_proj.weight") @ x[t],
                w64(weights, f"{a}q_a_layernorm.weight"),
                c.rms_norm_eps,
            )
            q = w64(weights, f"{a}q_b_proj.weight") @ qa
        compressed = w64(weights, f"{a}kv_a_proj_with_mqa.weight") @ x[t]
        latent = rms_norm(
            compressed[: c.kv_lora_rank], w64(weights, f"{a}kv_a_layernorm.weight"), c.rms_norm_eps
        )
        k_rope = rotate(c, compressed[c.kv_lora_rank :], t)
        kv = w64(weights, f"{a}kv_b_proj.weight") @ latent
        q_heads, k_heads, v_heads = [], [], []
        for h in range(heads):
            qh = q[h * qk : (h + 1) * qk]
            q_heads.append(torch.cat([qh[:nope], rotate(c, qh[nope:], t)]))
            kvh = kv[h * (nope + vdim) : (h + 1) * (nope + vdim)]
            k_heads.append(torch.cat([kvh[:nope], k_rope]))
            v_heads.append(kvh[nope:])
        queries.append(q_heads)
        keys.append(k_heads)
        values.append(v_heads)
    out = torch.zeros(length, heads * vdim, dtype=torch.float64)
    for t in range(length):
        for h in range(heads):
            logits = [float(queries[t][h] @ keys[j][h]) * scale for j in range(t + 1)]
            top = max(logits)
            probs = [math.exp(v - top) for v in logits]
            total = sum(probs)
            mixed = sum(p / total * values[j][h] for j, p in enumerate(probs))
            out[t, h * vdim : (h + 1) * vdim] = mixed
    return out @ w64(weights, f"{a}o_proj.weight").T


# ---- the whole model -----------------------------------------------------------------


def forward(
    config: DeepseekConfig, weights: Weights, prompts: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(final hidden states [T, H], last-token logits [R, V])`` in float64."""
    eps = config.rms_norm_eps
    finals, logits = [], []
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    for prompt in prompts:
        h = w64(weights, "model.embed_tokens.weight")[torch.tensor(list(prompt))]
        for layer in range(config.num_hidden_layers):
            p = f"model.layers.{layer}."
            normed = torch.stack(
                [rms_norm(v, w64(weights, f"{p}input_layernorm.weight"), eps) for v in h]
            )
            h = h + attention_request(config, weights, layer, normed)
            normed = torch.stack(
                [rms_norm(v, w64(weights, f"{p}post_attention_layernorm.weight"), eps) for v in h]
            )
            if config.is_moe_layer(layer):
                h = h + moe(config, weights, layer, normed)
            else:
                h = h + torch.stack([mlp(weights, f"{p}mlp.", v) for v in normed])
        final = torch.stack([rms_norm(v, w64(weights, "model.norm.weight"), eps) for v in h])
        finals.append(final)
        logits.append(w64(weights, head) @ final[-1])
    return torch.cat(finals), torch.stack(logits)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    diff = (out.double().cpu() - reference.double().cpu()).norm()
    return float(diff / reference.double().cpu().norm().clamp_min(1e-30))

"""Multi-head latent attention (MLA) for prefill: causal, per request, in chunks.

Prefill uses the straightforward form: queries from ``q_proj`` (or the low-rank
``q_a_proj -> q_a_layernorm -> q_b_proj``), a shared compressed latent and one rotary
key per token from ``kv_a_proj_with_mqa``, per-head keys/values expanded from the
normalised latent by ``kv_b_proj``. Each request attends causally to itself only; a
segment that starts mid-request (a later stage, or a later chunk of a long prompt)
attends to the request's earlier tokens through :class:`~afd_models.batch.KVCache`, which
keeps the compressed latent and rope key per token; they are expanded to per-head keys and
values here, row by row exactly as the request's own tokens are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn import functional as nnf
from torch.nn.attention import SDPBackend, sdpa_kernel

from afd_models.batch import KVCache, Segment
from afd_models.config import DeepseekConfig
from afd_models.norm import RMSNorm
from afd_models.params import ParamSpec
from afd_models.rotary import RotaryEmbedding
from afd_models.weights import WeightSource

CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The attention kernels allowed on a GPU: every one but cuDNN's, which builds an execution
plan per sequence length. On one H200 (torch 2.11, MLA's head dims q/k 192, v 128, 128
heads, bf16, ~2K tokens) cuDNN's first call of a new length took 48 ms and a repeat 0.7
ms; memory-efficient attention took 2.5 ms and 2.4 ms (``tools/gpu/sdpa_shapes.py``).
Prompt lengths of a prefill workload are nearly all distinct, so cuDNN paid its 48 ms per
request and layer: in ``afd run --mode all`` the first mode paid them and the next found
the plans cached (v3-slice ``uneven``: 245 ms of attention-side compute per layer for sync
run first, 35 ms run second). Flash attention needs equal q/k/v head dims, which MLA does
not have, so memory-efficient attention is what runs."""


LowerRightBias = Callable[[int, int], Any]
"""``torch.nn.attention.bias.causal_lower_right``: ``(queries, keys) -> CausalBias``."""


def _lower_right_bias() -> LowerRightBias:
    """torch's lower-right causal bias, imported when a GPU model is built (so every GPU
    process that builds the attention imports ``torch._dynamo`` and Triton at start-up,
    a few seconds, whether or not its prompts are ever cut). Not at this module's import:
    with it Triton's bindings (triton 3.9) print leak reports at exit in every process,
    CPU ones included. Not inside a step either: a timed step that paid the import stalled
    the monolithic baseline on one H200 by seconds (``docs/benchmarks.md``)."""
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right


def _allowed_kernels(device: torch.device) -> AbstractContextManager[None]:
    """Scope :data:`CUDA_SDPA_BACKENDS` over one layer's segments (entered once per layer,
    not per segment); nothing to choose on the CPU, which has no per-shape planning."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else nullcontext()


class MLAttention:
    """One layer's MLA projections and the causal attention over a stage's segments."""

    def __init__(
        self,
        config: DeepseekConfig,
        layer: int,
        specs: dict[str, ParamSpec],
        source: WeightSource,
        rotary: RotaryEmbedding,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.layer = layer
        self.rotary = rotary
        names = [n for n in specs if n not in ("input_layernorm", "post_attention_layernorm")]
        self.weights = {n: source.get(specs[n], dtype, device) for n in names}
        self.names = {n: specs[n].name for n in names}
        eps = config.rms_norm_eps
        self.q_a_norm = (
            RMSNorm(self.weights["q_a_layernorm"], eps) if "q_a_layernorm" in self.weights else None
        )
        self.kv_a_norm = RMSNorm(self.weights["kv_a_layernorm"], eps)
        self.scale = config.softmax_scale
        self._lower_right = _lower_right_bias() if device.type == "cuda" else None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {self.names[n]: t for n, t in self.weights.items()}

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        if self.q_a_norm is None:
            return nnf.linear(x, w["q_proj"])
        return nnf.linear(self.q_a_norm(nnf.linear(x, w["q_a_proj"])), w["q_b_proj"])

    def __call__(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        segments: Sequence[Segment],
        cache: KVCache,
    ) -> torch.Tensor:
        """Attention output ``[t, H]`` for the rows of ``x`` (one stage)."""
        c = self.config
        t, heads = x.shape[0], c.num_attention_heads
        nope, rope, vdim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        q_nope, q_pe = torch.split(self._queries(x).view(t, heads, nope + rope), [nope, rope], -1)
        compressed = nnf.linear(x, self.weights["kv_a_proj_with_mqa"])
        latent, k_pe = torch.split(compressed, [c.kv_lora_rank, rope], -1)
        latent = self.kv_a_norm(latent)
        cos, sin = self.rotary.cos_sin(positions)
        q_pe = self.rotary(q_pe, cos, sin)
        k_pe = self.rotary(k_pe.reshape(t, 1, rope), cos, sin).reshape(t, rope)
        queries = torch.cat((q_nope, q_pe), dim=-1)
        out = x.new_empty(t, heads, vdim)
        with _allowed_kernels(x.device):
            for seg in segments:
                seg_latent, seg_rope = latent[seg.rows], k_pe[seg.rows]
                if seg.start or not seg.ends_request:
                    seg_latent, seg_rope = cache.extend(self.layer, seg, seg_latent, seg_rope)
                k, v = self._expand(seg_latent, seg_rope)
                out[seg.rows] = self._attend(queries[seg.rows], k, v, seg.start)
        return nnf.linear(out.reshape(t, heads * vdim), self.weights["o_proj"])

    def _expand(
        self, latent: torch.Tensor, rope_keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values ``[n, heads, d]`` from normed latents and rope keys."""
        c = self.config
        n, heads = latent.shape[0], c.num_attention_heads
        kv = nnf.linear(latent, self.weights["kv_b_proj"]).view(
            n, heads, c.qk_nope_head_dim + c.v_head_dim
        )
        k_nope, values = torch.split(kv, [c.qk_nope_head_dim, c.v_head_dim], -1)
        rope = rope_keys.reshape(n, 1, c.qk_rope_head_dim).expand(n, heads, c.qk_rope_head_dim)
        return torch.cat((k_nope, rope), dim=-1), values

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """Causal attention ``[len, heads, v_head_dim]`` of queries ``q`` ``[len, heads,
        qk_head_dim]`` at positions ``start..start+len`` over keys ``k`` / values ``v``
        ``[start+len, heads, d]`` at positions ``0..start+len`` (model dtype and device)."""
        # [1, heads, len, d]: with a batch dimension, fused kernels (cuDNN, flash,
        # memory-efficient) apply; 3-D inputs fall back to the unfused math kernel.
        assert k.shape[0] == start + q.shape[0], "keys end where the queries end"
        q_, k_, v_ = (a.transpose(0, 1).unsqueeze(0) for a in (q, k, v))
        if start == 0:
            out = nnf.scaled_dot_product_attention(q_, k_, v_, is_causal=True, scale=self.scale)
        else:
            # The keys end where the queries end, so the causal mask is the lower-right
            # aligned one. On a GPU, as a CausalBias, the memory-efficient kernel applies it
            # itself and skips the tiles it masks whole, where a materialised boolean mask
            # made it read a [len, start+len] bias and compute every tile (docs/benchmarks.md,
            # "Stage pieces' attention"). On the CPU the bias is materialised into this very
            # mask (bitwise equal outputs), so the mask is built here, without the import.
            mask: Any
            if self._lower_right is not None:
                mask = self._lower_right(q.shape[0], k.shape[0])
            else:
                qpos = torch.arange(start, start + q.shape[0], device=q.device)
                kpos = torch.arange(k.shape[0], device=q.device)
                mask = kpos[None, :] <= qpos[:, None]
            out = nnf.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, scale=self.scale)
        return out.squeeze(0).transpose(0, 1)

"""The ``routed_scaling_factor`` rule, in one place for every execution path.

The reference (and vLLM's DeepSeek) multiplies the routed branch of every MoE layer by
``routed_scaling_factor`` -- except in float16, where that product can overflow. There
the routed branch is left unscaled and the *shared* branch is divided by the factor
instead, so the MoE output is the true output divided by the factor. To keep the
residual stream consistent, everything else added to it (the embeddings, attention and
dense-MLP outputs) is divided by the factor too: the whole stream is then the true one
scaled by ``1 / routed_scaling_factor``, which the next RMSNorm (and the final norm)
cancels. bfloat16 and float32 use the plain rule.

The routed factor is folded into the top-k weights (``weights * routed``): the weights
never travel, so the attention side applies it during the combine, and the monolithic
model applies it in the same place -- both paths compute the same products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BranchScales:
    """Multipliers of the routed weights, the shared-expert output and the residual stream."""

    routed: float
    shared: float
    stream: float

    @classmethod
    def for_dtype(cls, routed_scaling_factor: float, dtype: torch.dtype) -> BranchScales:
        if dtype == torch.float16:
            inverse = 1.0 / routed_scaling_factor
            return cls(routed=1.0, shared=inverse, stream=inverse)
        return cls(routed=routed_scaling_factor, shared=1.0, stream=1.0)

"""Model families: what a family's decoder layer is made of, named once, so that the one decoder layer
(`jaxlong.models.llama.DecoderLayer`), its attention in every context-parallel mode, the memory techniques and
generation serve every family.

- `llama`: Llama-3.x, Qwen3 (`model.qk_norm`), SmolLM2. RMSNorm `x * w`, pre-norm residual sublayers, SwiGLU,
  every layer global (Grattafiori et al. 2024, arXiv 2407.21783; Yang et al. 2025, arXiv 2505.09388).
- `gemma3`: Gemma 3 (Gemma Team 2025, arXiv 2503.19786, section 2; transformers `models/gemma3`). RMSNorm
  `x * (1 + w)` in float32 (w stored as on the Hub); QK-norm; a norm before *and after* both the attention and the
  MLP, the post-norms inside the residual (`x + post_norm(sublayer(pre_norm(x)))`); GeGLU with the tanh GELU
  (`gelu_pytorch_tanh`); embeddings times sqrt(hidden) rounded to the compute dtype; tied embeddings; local layers
  with a sliding window of `model.sliding_window` positions and their own RoPE base (`model.rope_local_theta`),
  every `model.sliding_window_pattern`-th layer global (or as `model.layer_types` lists them).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

__all__ = ["Family", "FamilyName", "FAMILIES", "GLOBAL", "LOCAL", "family_of", "embed_scale", "layer_kinds", "query_scale"]

FamilyName = Literal["llama", "gemma3"]  # `model.family`
GLOBAL, LOCAL = 0, 1  # a layer's kind: full (causal) attention, or a sliding window


@dataclasses.dataclass(frozen=True)
class Family:
    """The parts of a family's decoder layer.

    Attributes:
      name: `model.family`.
      norm_offset: every RMSNorm scales by `norm_offset + w` (Gemma: 1, computed in float32).
      sandwich_norms: norms after the attention and the MLP too, inside the residual (`post_attn_norm`,
        `post_mlp_norm`).
      activation: the gated MLP's activation, `silu` (SwiGLU) or `gelu_tanh` (GeGLU, `gelu_pytorch_tanh`).
      embed_scale: the embeddings are multiplied by sqrt(hidden), rounded to the compute dtype.
      qk_norm: the family always has QK-norm (otherwise `model.qk_norm` says).
      windows: the family may have sliding-window layers.
    """

    name: str
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    qk_norm: bool = False
    windows: bool = False


FAMILIES = {
    "llama": Family("llama"),
    "gemma3": Family("gemma3", norm_offset=1.0, sandwich_norms=True, activation="gelu_tanh", embed_scale=True,
                     qk_norm=True, windows=True),
}


def family_of(m) -> Family:
    """The `Family` of a model section `m` (`model.family`)."""
    return FAMILIES[m.family]


def embed_scale(m, dtype) -> jax.Array | None:
    """sqrt(hidden) in `dtype` (rounded there, as transformers rounds it to the embedding's dtype: sqrt(3840) is 62.0
    in bfloat16), or None for a family without it."""
    return jnp.asarray(math.sqrt(m.hidden), dtype) if family_of(m).embed_scale else None


def layer_kinds(m) -> tuple[int, ...]:
    """Each layer's kind, `GLOBAL` or `LOCAL`, `[layers]`: all global without a window (`model.sliding_window=0`);
    else `model.layer_types` (`sliding_attention` local, `full_attention` global) where given, or every
    `model.sliding_window_pattern`-th layer global (Gemma 3: 5 local, then 1 global; the first layer local)."""
    if not m.sliding_window:
        return (GLOBAL,) * m.layers
    if m.layer_types:
        return tuple(LOCAL if t == "sliding_attention" else GLOBAL for t in m.layer_types)
    return tuple(GLOBAL if (i + 1) % m.sliding_window_pattern == 0 else LOCAL for i in range(m.layers))


def query_scale(m) -> float:
    """The factor on the queries that turns the kernels' `1/sqrt(head_dim)` into `1/sqrt(query_pre_attn_scalar)`
    (Gemma 3's attention scale; 27B: 168 with head_dim 128): `sqrt(head_dim / query_pre_attn_scalar)`, or 1."""
    s = m.query_pre_attn_scalar
    return 1.0 if not s or s == m.head_dim else math.sqrt(m.head_dim / s)

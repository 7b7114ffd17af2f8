"""The attention sublayer's input side, written once: RMSNorm -> Q/K/V projections -> QK-norm -> RoPE.

Every path through a decoder layer projects its queries, keys and values here: the Ulysses sublayer in training
(`jaxlong.parallel.ulysses.sublayer`), the whole-prompt prefill's cache, the chunked prefill and the decode step
(`jaxlong.models.llama.DecoderLayer.project`). U-Pipe keeps its own fused, head-chunked projection on purpose (it
never holds all heads' q at once: `jaxlong.parallel.upipe`, arXiv 2602.21196 section 3.3).

The tensors `attn_norm_out`, `query_proj`, `key_proj` and `value_proj` are named for remat policies
(`jaxlong.layers.remat`); outside a `jax.checkpoint` the names do nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlong.layers import blocks as L

__all__ = ["project_qkv"]


def project_qkv(x: jax.Array, norm: jax.Array, wq: jax.Array | None, wk: jax.Array, wv: jax.Array,
                qk_norm: tuple[jax.Array, jax.Array] | None, rope: tuple[jax.Array, jax.Array], eps: float,
                place: Callable[[jax.Array], jax.Array] = lambda a: a, q_scale: float = 1.0):
    """Queries, keys and values of a decoder layer from its input, as its attention reads them.

    `q = RoPE(qn(W_q n(x)))`, `k = RoPE(kn(W_k n(x)))`, `v = W_v n(x)` with `n` the attention RMSNorm and `qn`, `kn`
    Qwen3's per-head RMSNorms over head_dim (Yang et al. 2025, arXiv 2505.09388, section 2); RoPE as
    `jaxlong.layers.blocks.apply_rope` (Su et al. 2021, arXiv 2104.09864).

    Args:
      x: the layer input `[batch, seq, hidden]`.
      norm: the attention RMSNorm's scale `[hidden]`.
      wq: `[hidden, heads, head_dim]`, or None when only the keys and values are wanted (a cache); wk, wv:
        `[hidden, kv_heads, head_dim]`, in the compute dtype (gathered by the caller).
      qk_norm: (q_norm, k_norm) scales `[head_dim]`, or None.
      rope: the RoPE tables `(cos, sin)`, each `[batch or 1, seq, head_dim / 2]`, of the tokens' positions
        (`jaxlong.layers.blocks.rope_tables`).
      eps: the RMSNorms' epsilon.
      place: applied to q, k and v before they are named (a sharding constraint); identity by default.
      q_scale: multiplies q after RoPE (`model.query_pre_attn_scalar`: the kernels' `1/sqrt(head_dim)` then gives
        `1/sqrt(query_pre_attn_scalar)`); 1 leaves q as it is.

    Returns:
      `(q [batch, seq, heads, head_dim] or None, k, v [batch, seq, kv_heads, head_dim])` in x's dtype.
    """
    cos, sin = rope
    h = checkpoint_name(L.rms_norm(x, norm, eps), "attn_norm_out")
    k = jnp.einsum("bsh,hnd->bsnd", h, wk)
    v = jnp.einsum("bsh,hnd->bsnd", h, wv)
    q = None if wq is None else jnp.einsum("bsh,hnd->bsnd", h, wq)
    if qk_norm is not None:
        k = L.rms_norm(k, qk_norm[1], eps)
        q = None if q is None else L.rms_norm(q, qk_norm[0], eps)
    if q is not None:
        q = L.apply_rope(q, cos, sin)
        q = checkpoint_name(place(q if q_scale == 1.0 else (q * q_scale).astype(q.dtype)), "query_proj")
    k = checkpoint_name(place(L.apply_rope(k, cos, sin)), "key_proj")
    return q, k, checkpoint_name(place(v), "value_proj")

"""Stateless building blocks of the Llama-3 decoder: RMSNorm and rotary embeddings (RoPE).

All take and return `[batch, seq, ...]` arrays; norms and the RoPE rotation are computed in float32 and cast
back to the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm (Zhang & Sennrich 2019): `x / sqrt(mean(x^2) + eps) * scale`. x `[..., hidden]`, scale `[hidden]`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin tables `[..., seq, head_dim/2]` (float32) for integer token `positions` `[..., seq]`.

    Frequencies `theta^(-2i/head_dim)` (Su et al. 2021, RoFormer eq. 15). Positions must be *global* token
    indices: under context parallelism a shard starting at token `r*S/C` passes `r*S/C + arange(S/C)`.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate `x` `[batch, seq, heads, head_dim]` by RoPE tables `[batch or 1, seq, head_dim/2]`.

    Uses the "rotate half" pairing of Llama checkpoints in the Hugging Face layout (dimension i pairs with
    i + head_dim/2). The rotation is orthogonal, so its transpose (the backward) is the rotation by -angle.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


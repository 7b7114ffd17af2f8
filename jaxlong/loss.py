"""Next-token cross-entropy with a loss mask, averaged over the global number of valid tokens.

The arrays are global (sharded by the mesh), so `sum(loss * mask) / sum(mask)` is the mean over every valid
token of every context shard and data-parallel replica: sharding never changes the loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_losses(hidden: jax.Array, head: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy `[b, s]` (float32, nats) from hidden `[b, s, hidden]`, head `[hidden, vocab]`,
    integer targets `[b, s]`. Logits are computed in float32 for a stable log-sum-exp."""
    logits = jnp.einsum("bsh,hv->bsv", hidden, head, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - target_logit


def masked_mean(losses: jax.Array, mask: jax.Array) -> jax.Array:
    """`sum(losses * mask) / max(sum(mask), 1)` over the whole (global) batch."""
    mask = mask.astype(jnp.float32)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) over the valid tokens of the global batch."""
    return masked_mean(token_losses(hidden, head, targets), mask)

"""Next-token cross-entropy with a loss mask, averaged over the global number of valid tokens.

The arrays are global (sharded by the mesh), so `sum(loss * mask) / sum(mask)` is the mean over every valid
token of every context shard and data-parallel replica: sharding never changes the loss.

Targets equal to `IGNORE_INDEX` (-100, as in Hugging Face / PyTorch batches) are ignored: their mask is zeroed.
A target outside `[0, vocab)` at a masked position contributes exactly 0 (the gather is clipped, never NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IGNORE_INDEX = -100  # target id meaning "no loss here" (torch.nn.CrossEntropyLoss's default ignore_index)


def effective_mask(targets: jax.Array, mask: jax.Array) -> jax.Array:
    """float32 `[b, s]`: `mask` with the positions whose target is `IGNORE_INDEX` set to 0."""
    return jnp.where(targets == IGNORE_INDEX, 0.0, mask.astype(jnp.float32))


def token_losses(hidden: jax.Array, head: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy `[b, s]` (float32, nats) from hidden `[b, s, hidden]`, head `[hidden, vocab]`,
    integer targets `[b, s]`. Logits are computed in float32 for a stable log-sum-exp. A target outside
    `[0, vocab)` (e.g. `IGNORE_INDEX`) gives a finite, meaningless value: mask it out."""
    logits = jnp.einsum("bsh,hv->bsv", hidden, head, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe = jnp.clip(targets, 0, logits.shape[-1] - 1)
    target_logit = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    return lse - target_logit


def token_entropies(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """Entropy of each position's next-token distribution `softmax(hidden @ head)`, float32 `[b, s]` in nats, with
    no gradient (a metric: GRPO's `entropy`)."""
    logits = jnp.einsum("bsh,hv->bsv", hidden, head, preferred_element_type=jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jax.lax.stop_gradient(-jnp.sum(jnp.exp(logp) * logp, axis=-1))


def cross_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) over the valid tokens of the global batch: positions where
    `mask` is 0 or the target is `IGNORE_INDEX` are left out; finite for any target at such a position:
    `sum(losses * mask) / max(sum(mask), 1)` over the whole (global) batch."""
    mask = effective_mask(targets, mask)
    return jnp.sum(token_losses(hidden, head, targets) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

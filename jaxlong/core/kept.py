"""The names under which an attention op's output and log-sum-exp are tagged for `remat.keep_attention`.

Every differentiable attention op (the kernels' `custom_vjp`s, ring attention's, U-Pipe's) calls
`keep_attention_residuals` in its forward rule on the output and lse it saves for its backward. The tags are
`jax.ad_checkpoint.checkpoint_name`s, identities unless a remat policy names them: the policy of a layer that keeps
its attention (`jaxlong.layers.remat.make_policy(cfg, keep=True)`) saves them (or offloads them to pinned host
memory), so that the backward's recomputation of the layer finds them and skips the attention forward. Kept here,
below `kernels/` and `layers/`, because both use the names.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

KEPT_OUTPUT = "kept_attention_output"
KEPT_LSE = "kept_attention_lse"
KEPT_NAMES = (KEPT_OUTPUT, KEPT_LSE)


def keep_attention_residuals(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Tag an attention op's output and log-sum-exp (the residuals its backward takes besides q, k, v) so that
    `remat.keep_attention` can keep them; identity otherwise. Call it in the op's `custom_vjp` forward rule and
    use what it returns both as the op's output and as the residuals (an untagged output would be recomputed for
    the layers after it). Shapes are the op's, e.g. `[batch, seq, heads, head_dim]` and `[batch, heads, seq]`."""
    return checkpoint_name(out, KEPT_OUTPUT), checkpoint_name(lse, KEPT_LSE)

"""Segment ids: what a query may see of a packed row, as every attention kernel reads them.

A row packs documents and shared-prefix groups. Its segment ids are int32 `[batch, seq]`, one per token:

* bits 0-22: the document (1, 2, ... along the row; 0 = padding), below `MAX_DOCUMENTS` = 2**23;
* bits 23-30: the branch (0 = an ordinary document or a group's shared prefix; 1 to `MAX_BRANCHES` - 1 = one of
  the group's branches).

A query at row index t sees key j iff `j <= t` (causal), both lie in one run of the same document (document
masking; `segment_starts`), and the key is in the shared prefix or in the query's own branch (`visible`): branch
`b` of a group attends to the group's prefix and to itself, never to a sibling. A group is its prefix followed by
its branches: G completions of one prompt (GRPO, arXiv 2402.03300 section 4.1; DPO's chosen and rejected) are
computed on the prompt once, P + G * R tokens instead of G * (P + R) (PrefixGrouper, arXiv 2506.05433 section 3).
Each branch's RoPE positions continue from its prefix's end (the batch's `positions`); the row index alone does not
give them. Sliding windows count positions, so a windowed layer does not take shared-prefix rows
(`jaxlong.kernels.blockwise`).

Ordinary rows have branch 0 everywhere, and then the masks are exactly document masking.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["BRANCH_SHIFT", "MAX_DOCUMENTS", "MAX_BRANCHES", "encode", "documents", "branches", "visible",
           "segment_starts"]

BRANCH_SHIFT = 23
MAX_DOCUMENTS = 1 << BRANCH_SHIFT  # documents per row: ids 1 .. MAX_DOCUMENTS - 1
MAX_BRANCHES = 1 << (31 - BRANCH_SHIFT)  # branches per group: 1 .. MAX_BRANCHES - 1
_DOCUMENT_BITS = MAX_DOCUMENTS - 1


def encode(document, branch):
    """Segment ids of tokens of `document` (int >= 0, < `MAX_DOCUMENTS`) in `branch` (int >= 0, <
    `MAX_BRANCHES`), numpy or JAX arrays of one shape (or scalars); int32 of that shape.

    Raises:
      ValueError: a concrete document or branch out of range (numpy inputs are checked; traced ones are not)."""
    if not isinstance(document, jax.Array) and not isinstance(branch, jax.Array):
        d, b = np.asarray(document), np.asarray(branch)
        if d.size and (d.min() < 0 or d.max() >= MAX_DOCUMENTS):
            raise ValueError(f"segment ids: documents must lie in [0, {MAX_DOCUMENTS}); got {d.min()}..{d.max()}")
        if b.size and (b.min() < 0 or b.max() >= MAX_BRANCHES):
            raise ValueError(f"segment ids: branches must lie in [0, {MAX_BRANCHES}) (a group of at most "
                             f"{MAX_BRANCHES - 1} completions); got {b.min()}..{b.max()}")
        return (d.astype(np.int32) | (b.astype(np.int32) << BRANCH_SHIFT)).astype(np.int32)
    return jnp.asarray(document, jnp.int32) | (jnp.asarray(branch, jnp.int32) << BRANCH_SHIFT)


def documents(ids):
    """The document of each segment id (its branch cleared), int32, same shape (numpy or JAX)."""
    return ids & _DOCUMENT_BITS


def branches(ids):
    """The branch of each segment id (0: a prefix or an ordinary document), int32, same shape."""
    return ids >> BRANCH_SHIFT


def visible(q_ids, kv_ids):
    """Whether a key of segment id `kv_ids` may be seen by a query of `q_ids` beyond causality and runs
    (broadcasting arrays): same document, and the key in the prefix (branch 0) or in the query's branch."""
    return (kv_ids == q_ids) | (kv_ids == documents(q_ids))


def segment_starts(segment_ids):
    """Index of the first token of each token's run of one document (branches are one run with their prefix),
    int32 `[batch, seq]`.

    `segment_ids`: int `[batch, seq]` (module docstring). For packed (contiguous) documents this is where each
    token's document starts in the row. Non-decreasing along the sequence. O(seq) work and memory.

    Raises:
      ValueError: `segment_ids` not two-dimensional.
    """
    seg = jnp.asarray(segment_ids)
    if seg.ndim != 2:
        raise ValueError(f"segment_ids must be [batch, seq]; got shape {seg.shape}")
    doc = documents(seg)
    pos = lax.broadcasted_iota(jnp.int32, seg.shape, 1)
    new_run = jnp.concatenate([jnp.ones_like(doc[:, :1], dtype=bool), doc[:, 1:] != doc[:, :-1]], axis=1)
    return lax.cummax(jnp.where(new_run, pos, 0), axis=1)

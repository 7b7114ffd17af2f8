"""Sliding-window layers under ring attention: a halo exchange instead of the ring.

A local layer's query at position t sees the keys at `t - W + 1 .. t` only (Gemma 3, arXiv 2503.19786 section 2).
Under ring attention (`jaxlong.parallel.ring`) each ring rank holds two half-chunks of `c = S / (2 R)` tokens in
the zigzag layout: chunk r and chunk 2R - 1 - r. Every query of a half-chunk sees its own half-chunk (causal, within
the window) and at most the last W - 1 keys before it, which lie at the end of the previous chunk in token order:

- chunk r's predecessor is chunk r - 1, rank r - 1's first half (none for rank 0);
- chunk 2R - 1 - r's predecessor is chunk 2R - 2 - r, rank r + 1's second half, or for rank R - 1 its own first
  half (chunk R - 1).

So instead of circulating every rank's K/V around the ring (R - 1 steps of S/R rows), each rank sends the last
`h` rows of its two half-chunks' K/V one hop (`lax.ppermute`: the first halves' tails to rank r + 1, the second
halves' tails to rank r - 1), `h` the window less one rounded up to the kernel's tile; the transpose of the
ppermute (autodiff) sends their gradients back. No all-to-all is involved, so the KV-head limit of Ulysses does
not apply to the ring part. Each half-chunk then runs the windowed blockwise kernel on its halo and itself
(`[h + c]` keys; the halo's query rows are zeros and their outputs dropped), the document mask given by run ids,
which agree across chunks (`jaxlong.parallel.ring.run_ids`); a rank without a predecessor marks its halo with the
id -1, which no query has. The halo's padding rows, farther than W - 1 from every query, are masked by the window.

This is the halo exchange of Megatron-LM's open PR #5597 (`swa_p2p`) in the zigzag layout. A window wider than a
half-chunk would need more hops; it is refused (`check_halo`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import RING_AXIS
from jaxlong.kernels.blockwise import blockwise_attention
from jaxlong.parallel.ring import run_ids

__all__ = ["halo_tiles", "halo_rows", "check_halo", "halo_attention_local"]


def halo_tiles(half: int, block_q: int, block_k: int) -> tuple[int, int]:
    """The kernel's tiles over a half-chunk and its halo: the largest divisors of the `half`-chunk's length that are at
    most `block_q` and `block_k`."""
    def tile(block):
        return max(t for t in range(1, min(block, half) + 1) if half % t == 0)
    return tile(block_q), tile(block_k)


def halo_rows(window: int, half: int, block_q: int, block_k: int) -> int:
    """Rows of K/V each half-chunk receives: the window less one, rounded up to a whole number of the kernel's tiles
    (`halo_tiles`), so that the halo and the half-chunk tile evenly."""
    tile = math.lcm(*halo_tiles(half, block_q, block_k))
    return -(-(window - 1) // tile) * tile


def check_halo(window: int, seq_len: int, ring: int, block_q: int, block_k: int) -> None:
    """A sliding window under ring attention needs its halo within one half-chunk (`seq_len / (2 mesh.ring)`), unless
    it is as long as the sequence (it then masks nothing, and the layer runs as a global one).

    Raises:
      ConfigError: the halo (`halo_rows`) is longer than a half-chunk, naming what would fit."""
    if window >= seq_len:  # every query sees the whole sequence: the ring runs it as a global layer
        return
    half = seq_len // (2 * ring)
    h = halo_rows(window, half, block_q, block_k)
    if h > half:
        raise ConfigError(
            f"model.sliding_window={window} under mesh.ring={ring}: a local layer's halo ({h} tokens, the window less "
            f"one in whole tiles) is longer than a ring rank's half-chunk, seq_len/(2*mesh.ring) = {half} tokens; "
            f"wider windows would need more hops, which jaxlong does not take yet: give a smaller mesh.ring or a "
            f"longer seq_len", key="mesh.ring", value=ring, keys=("model.sliding_window", "seq_len"))


def halo_attention_local(q, k, v, *, window: int, block_q: int = 512, block_k: int = 512, segment_ids=None,
                         ids_are_runs: bool = False) -> jax.Array:
    """Sliding-window attention of one ring rank inside `jax.shard_map` over the `ring` axis (module docstring).

    Args:
      q: `[batch, S/R, heads, head_dim]`, this rank's two half-chunks in the zigzag layout; k, v: `[batch, S/R,
        kv_heads, head_dim]`.
      window: the local layer's window W in positions (> 0).
      block_q, block_k: the blockwise kernel's tiles.
      segment_ids: int `[batch, S]` of the whole sequence in the zigzag layout (as ring attention takes them), or
        None (each row one causal stream); `ids_are_runs`: they are run ids already.

    Returns:
      `[batch, S/R, heads, head_dim]`, like q.

    Raises:
      ConfigError: the halo is longer than a half-chunk (`check_halo`).
    """
    ring, r = lax.axis_size(RING_AXIS), lax.axis_index(RING_AXIS)
    b, n = q.shape[:2]
    c = n // 2
    check_halo(window, n * ring, ring, block_q, block_k)
    h = halo_rows(window, c, block_q, block_k)
    tq, tk = halo_tiles(c, block_q, block_k)
    if segment_ids is None:
        runs = jnp.zeros((b, n * ring), jnp.int32)
    else:
        runs = segment_ids.astype(jnp.int32) if ids_are_runs else run_ids(segment_ids, ring)

    def ids_at(rank, start):  # run ids of `h` rows from `start` in rank `rank`'s slots (clamped, masked by caller)
        return lax.dynamic_slice_in_dim(runs, jnp.clip(rank, 0, ring - 1) * n + start, h, axis=1)

    def tails(x):  # the last h rows of each half-chunk
        return x[:, c - h:c], x[:, n - h:]

    forward = [(i, i + 1) for i in range(ring - 1)]  # first halves' tails to the next rank
    backward = [(i + 1, i) for i in range(ring - 1)]  # second halves' tails to the previous rank
    halos = []
    for x in (k, v):
        t0, t1 = tails(x)
        from_prev = lax.ppermute(t0, RING_AXIS, forward)
        from_next = lax.ppermute(t1, RING_AXIS, backward)
        halos.append((from_prev, jnp.where(r == ring - 1, t0, from_next)))  # rank R - 1: its own first half
    none = jnp.full((b, h), -1, jnp.int32)
    halo_ids = (jnp.where(r == 0, none, ids_at(r - 1, c - h)),
                jnp.where(r == ring - 1, ids_at(r, c - h), ids_at(r + 1, n - h)))
    own_ids = lax.dynamic_slice_in_dim(runs, r * n, n, axis=1)
    outs = []
    for half in range(2):
        sl = slice(half * c, (half + 1) * c)
        qh = jnp.concatenate([jnp.zeros((b, h, *q.shape[2:]), q.dtype), q[:, sl]], axis=1)
        kh = jnp.concatenate([halos[0][half], k[:, sl]], axis=1)
        vh = jnp.concatenate([halos[1][half], v[:, sl]], axis=1)
        ids = jnp.concatenate([halo_ids[half], own_ids[:, sl]], axis=1)
        out = blockwise_attention(qh, kh, vh, causal=True, block_q=tq, block_k=tk, segment_ids=ids, window=window)
        outs.append(out[:, h:])
    return jnp.concatenate(outs, axis=1)

"""Exact blockwise (flash-style) attention in pure JAX and the dense reference; the backend choice and dispatch is
`jaxlong.kernels.backend` (the cuDNN kernel pair with lse in and out is `jaxlong.kernels.cudnn`; the Pallas GPU kernel
pair with segment ids is `jaxlong.kernels.pallas_gpu`).

Layout (everywhere in this module):

* `q`: `[batch, seq, heads, head_dim]`
* `k`, `v`: `[batch, seq, kv_heads, head_dim]` with `heads % kv_heads == 0`. Grouped-query attention (GQA): query
  head `h` attends with kv head `h // (heads // kv_heads)`. `kv_heads == heads` is ordinary multi-head attention.
* output: same shape and dtype as `q`.
* `lse` (log-sum-exp of the scaled scores per query row): float32 `[batch, heads, seq]`.

For `causal=True` queries and keys share one sequence length and one origin (query `t` sees keys `0..t`); an unmasked
call (`causal=False`) may take a key block of another length `kv_seq` (`k`, `v`: `[batch, kv_seq, kv_heads, head_dim]`,
ring attention's remote blocks). Scores are `q . k / sqrt(head_dim)`.

Sliding windows (`window` = W > 0, causal only; Gemma 3's local layers, arXiv 2503.19786 section 2): query `t`
sees keys `t - W < k <= t`, itself and the W - 1 before it (transformers' `sliding_window`), combined with the
causal and document masks. The key tiles wholly before a query tile's window (forward) and the query tiles wholly
past a key tile's reach (backward) are not visited, so a window of W costs about `W / (seq / 2)` of causal
attention's tiles (`window_tiles` counts them).

Packed documents (`segment_ids`, int32 `[batch, seq]`, 0 = padding): a query attends only to the earlier keys of its own
*run* of equal segment ids (document masking, block-diagonal causal). Packed documents are contiguous, so a run is a
document; an id that reappears after another id starts a new run. Every query sees at least itself, so no softmax row is
empty (padding tokens attend to earlier padding; their outputs are meant to be masked out of the loss). Segment ids
require `causal=True`. The blockwise kernels compute each token's run start (`segment_starts`, `[batch, seq]` int32,
O(seq)) and from it loop bounds per tile: kv tiles before the first run that a query tile touches (forward) and query
tiles past the last run that touches a kv tile (backward) are not visited, so `n` equal documents cost about `1/n` of
full causal attention. Nothing `[seq, seq]`-shaped and nothing per head is added. Segment ids may carry a shared
prefix's branches in their high bits (`jaxlong.core.segments`): a run is then a document with its branches, and a query
sees the run's prefix and its own branch, never a sibling (one more term in each tile's mask).

Per-query key bounds (`kv_starts`, `kv_ends`, int32 `[batch, seq]`, forward and backward): query `t` sees key
`j` only if `kv_starts[t] <= j < kv_ends[t]`, combined with the causal, window and document masks (and with
`kv_segment_ids`). `kv_starts` means what the Pallas kernel's does (`jaxlong.kernels.pallas_gpu`, which takes it
without the causal mask); both bounds let a chunk of queries attend to a KV cache in any order in which each
query's keys are contiguous (the chunked prefill, `jaxlong.generation.chunked`). The key tiles wholly outside a
query tile's bounds (forward) and the query tiles whose bounds miss a key tile (backward) are not visited. A query
that sees no key gets output 0 and lse -inf. The forward also reads head-major keys and values (`kv_head_major`, a
cache's layout) in place.

The blockwise kernels follow FlashAttention-2 (T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and
Work Partitioning", 2023, arXiv 2307.08691): Algorithm 1 (forward, online softmax over kv tiles per query tile, saving
only `out` and `lse`) and Algorithm 2 (backward, recomputing each score tile from `q`, `k` and `lse`). They are written
with `lax.map` / `lax.scan` / `lax.fori_loop` so XLA never materializes a `[seq, seq]` array; with `causal=True` the kv
(forward) or query (backward) tiles that lie entirely above the diagonal are not visited, roughly halving the work.
Inputs may be bf16/fp16: the matmuls take the input dtype with float32 accumulation, and softmax statistics,
accumulators and gradients are kept in float32, then cast back.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxlong.core.errors import ConfigError
from jaxlong.core.ordering import varying_axes, zeros_after
from jaxlong.core.kept import keep_attention_residuals
from jaxlong.core.segments import documents, segment_starts, visible
from jaxlong.kernels.layout import check_window

__all__ = [
    "segment_starts",
    "reference_attention",
    "reference_attention_with_lse",
    "blockwise_attention_fwd",
    "blockwise_attention_bwd",
    "blockwise_attention",
    "check_attention_block",
]

_F32 = jnp.float32
# Finite "minus infinity" for masked scores: exp(_NEG - finite) == 0 and no inf - inf NaNs.
_NEG = float(jnp.finfo(jnp.float32).min)


# ----------------------------------------------------------------------------- checks


def _check_shapes(q, k, v, causal: bool = True):
    """Validate the layout; return (batch, seq, heads, kv_heads, head_dim). The keys' sequence may differ
    from the queries' only without the causal mask (module docstring)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            "q, k, v must be 4-D [batch, seq, heads, head_dim]; got shapes "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape} and {v.shape}")
    b, s, h, d = q.shape
    if k.shape[0] != b or (causal and k.shape[1] != s) or k.shape[3] != d:
        raise ValueError(
            f"k/v shape {k.shape} does not match q shape {q.shape} in batch, seq (causal) or head_dim"
        )
    kvh = k.shape[2]
    if kvh == 0 or h % kvh != 0:
        raise ValueError(f"heads={h} must be a multiple of kv_heads={kvh}")
    return b, s, h, kvh, d


def _check_block(name: str, block: int, seq: int) -> int:
    """Clamp `block` to `seq` and check that it divides `seq`."""
    if int(block) != block or block <= 0:
        raise ValueError(f"{name} must be a positive integer, got {block!r}")
    block = min(int(block), seq)
    if seq % block != 0:
        best = max(c for c in range(1, block + 1) if seq % c == 0)
        raise ValueError(
            f"{name}={block} does not divide seq={seq}; use a divisor of {seq} "
            f"(largest one <= {block} is {best}), or a value >= {seq}"
        )
    return block


def _full(shape, value, *refs):
    """float32 `full(shape, value)` that varies over the same shard_map axes as `refs`.

    Loop carries must keep one type inside `jax.shard_map`; a plain `jnp.zeros` is mesh-invariant while the loop body's
    results vary with the inputs, so the buffer varies over the union of the axes of `refs`. It is built after the last
    of `refs` (see `jaxlong.core.ordering`): a constant buffer would be hoisted out of the enclosing layer scan and stay
    allocated across all of it.
    """
    return zeros_after(refs[-1], shape, _F32, varying_axes(*refs), value)


def _split_heads(x, kv_heads):
    """[b, s, heads, d] -> [b, s, kv_heads, group, d] (query heads grouped per kv head)."""
    b, s, h, d = x.shape
    return x.reshape(b, s, kv_heads, h // kv_heads, d)


def _check_segments(segment_ids, q, causal):
    """Validate `segment_ids` against q's `[batch, seq]`; return them as int32 (or None)."""
    if segment_ids is None:
        return None
    if not causal:
        raise ValueError("segment_ids (document masking) requires causal=True")
    b, s = q.shape[:2]
    if tuple(segment_ids.shape) != (b, s):
        raise ValueError(f"segment_ids must be [batch, seq] = {[b, s]}; got {tuple(segment_ids.shape)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array; got {segment_ids.dtype}")
    return segment_ids.astype(jnp.int32)


def window_tiles(seq: int, block_q: int, block_k: int, window: int = 0) -> int:
    """Score tiles `[block_q, block_k]` the causal blockwise kernel computes for one `[seq]` row and head, with a
    sliding `window` (> 0) or without (0): the tiles that every mask leaves entirely empty are not visited. Both
    the forward and the backward visit the same tiles."""
    bq, bk = min(block_q, seq), min(block_k, seq)
    total = 0
    for i in range(seq // bq):
        hi = min(seq // bk, ((i + 1) * bq + bk - 1) // bk)
        lo = max(0, i * bq - window + 1) // bk if window else 0
        total += hi - lo
    return total


def _tile_ends(ids, block):
    """First and last document of each tile, `[batch, n_tiles]` each (its range, for non-decreasing documents)."""
    ids = documents(ids)
    return ids[:, ::block], ids[:, block - 1::block]


def _overlapping(firsts, lasts, other_first, other_last):
    """For each tile with id range `[other_first, other_last]` (`[batch, n]`), the range `[lo, hi)` of
    the tiles with ranges `[firsts, lasts]` (`[batch, m]`, non-decreasing) that it overlaps in some batch
    row: int32 `[n]` each."""
    search = jax.vmap(jnp.searchsorted, in_axes=(0, 0, None))
    lo = search(lasts, other_first, "left").min(axis=0)
    hi = search(firsts, other_last, "right").max(axis=0)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def _check_rows(name: str, x, like):
    """`x` (None, or integer `[batch, seq]` of `like`'s leading axes, as the argument `name`) as int32."""
    if x is None:
        return None
    if tuple(x.shape) != tuple(like.shape[:2]) or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must be integer [batch, seq] = {list(like.shape[:2])}; got {x.dtype}{list(x.shape)}")
    return jnp.asarray(x).astype(jnp.int32)


def _check_kv_segments(segment_ids, kv_segment_ids, q, k, causal):
    """Validate a (query ids, key ids) pair for `causal=False`; return both as int32."""
    if causal or segment_ids is None:
        raise ValueError("kv_segment_ids (separate key segment ids) requires causal=False and segment_ids")
    return _check_rows("segment_ids", segment_ids, q), _check_rows("kv_segment_ids", kv_segment_ids, k)


# ------------------------------------------------------------------------- reference


def reference_attention(q, k, v, *, causal: bool = True, segment_ids=None, window: int = 0):
    """Materialized `softmax(q k^T / sqrt(d)) v` computed in float32 (tests only).

    Shapes as in the module docstring; `segment_ids` int `[batch, seq]` or None (document
    masking, see the module docstring); `window` > 0 a sliding window (module docstring). Returns `[batch, seq,
    heads, head_dim]` in `q.dtype`. Uses O(seq^2) memory. Raises ValueError on malformed shapes, segment ids or
    window.
    """
    return reference_attention_with_lse(q, k, v, causal=causal, segment_ids=segment_ids, window=window)[0]


def reference_attention_with_lse(q, k, v, *, causal: bool, segment_ids=None, window: int = 0, kv_starts=None,
                                 kv_ends=None):
    """`reference_attention` returning `(out, lse)`, lse float32 `[batch, heads, seq]` (tests only).

    `kv_starts`, `kv_ends`: int `[batch, seq]` or None, each query's first key and one past its last
    (`blockwise_attention_fwd`), combined with the other masks; a query that sees no key gets output 0 and lse
    -inf. Materializes the `[batch, heads, seq, kv_seq]` scores. Raises ValueError as `reference_attention` and on
    malformed bounds.
    """
    b, s, h, kvh, d = _check_shapes(q, k, v, causal)
    segment_ids = _check_segments(segment_ids, q, causal)
    window = check_window(window, causal)
    kv_starts, kv_ends = _check_rows("kv_starts", kv_starts, q), _check_rows("kv_ends", kv_ends, q)
    q5 = _split_heads(q.astype(_F32), kvh)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q5, k.astype(_F32)) / math.sqrt(d)
    mask, keys = None, jnp.arange(k.shape[1])[None, None, :]
    if causal:
        mask = jnp.tril(jnp.ones((s, s), dtype=bool))[None]
        if window:
            mask = mask & ~jnp.tril(jnp.ones((s, s), dtype=bool), -window)[None]  # q - k < window
        if segment_ids is not None:
            mask = mask & visible(segment_ids[:, :, None], segment_ids[:, None, :])
            mask = mask & (keys >= segment_starts(segment_ids)[:, :, None])
    for bound in (kv_starts is not None and keys >= kv_starts[:, :, None],
                  kv_ends is not None and keys < kv_ends[:, :, None]):
        if bound is not False:
            mask = bound if mask is None else mask & bound
    if mask is not None:
        scores = jnp.where(mask[:, None, None], scores, _NEG)
    lse = jax.nn.logsumexp(scores, axis=-1)  # [b, kvh, g, s]
    probs = jnp.exp(scores - lse[..., None])
    if kv_starts is not None or kv_ends is not None:  # rows that see no key: out 0, lse -inf
        probs = jnp.where(mask[:, None, None], probs, 0.0)
        lse = jnp.where(mask.any(axis=-1)[:, None, None], lse, -jnp.inf)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v.astype(_F32))
    return out.reshape(b, s, h, d).astype(q.dtype), lse.reshape(b, h, s)


# ------------------------------------------------------------------------- masks


class _Masks(NamedTuple):
    """What hides a key from a query, for every tile of one call: `causal` and `window`; `low` each query's first
    visible key (its run start with segment ids, `kv_starts`, or the later of the two) and `ends` one past its last
    (`kv_ends`), int32 `[batch, seq]` or None; `ids` the segment ids of one call's queries and keys (a shared
    prefix's branches, `jaxlong.core.segments`) or None; `q_ids`, `kv_ids` the (query, key) segment id pair or None;
    `empty`: a query may see no key (output 0, lse -inf); `bounded`: `kv_starts` or `kv_ends` given (the backward
    then zeroes the rows whose lse is -inf; with segment id pairs alone the lse is ring attention's, over every
    block, and finite)."""
    causal: bool
    window: int
    low: jax.Array | None
    ends: jax.Array | None
    ids: jax.Array | None
    q_ids: jax.Array | None
    kv_ids: jax.Array | None
    empty: bool
    bounded: bool


def _dims(q, k, v, block_q, block_k, causal):
    """The checks and tile sizes shared by the forward and backward kernels: `((b, s, h, kvh, d), (bq, bk))`."""
    dims = _check_shapes(q, k, v, causal)
    return dims, (_check_block("block_q", block_q, dims[1]), _check_block("block_k", block_k, k.shape[1]))


def _masks(q, k, causal, window, segment_ids, kv_segment_ids, kv_starts, kv_ends) -> _Masks:
    """Check the masking arguments (as `blockwise_attention_fwd` documents) and gather them."""
    q_ids = kv_ids = None
    if kv_segment_ids is not None:  # the query and key ids, checked as a pair
        q_ids, kv_ids = _check_kv_segments(segment_ids, kv_segment_ids, q, k, causal)
        segment_ids = None
    segment_ids = _check_segments(segment_ids, q, causal)
    kv_starts, kv_ends = _check_rows("kv_starts", kv_starts, q), _check_rows("kv_ends", kv_ends, q)
    low = None if segment_ids is None else segment_starts(segment_ids)
    if kv_starts is not None:
        low = kv_starts if low is None else jnp.maximum(low, kv_starts)
    offsets = kv_starts is not None or kv_ends is not None
    return _Masks(bool(causal), check_window(window, causal), low, kv_ends, segment_ids, q_ids, kv_ids,
                  offsets or q_ids is not None, offsets)


def _rows(x, i, bq):
    """Query tile i's rows of a `[batch, seq]` array."""
    return lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1)


def _tile_mask(m: _Masks, i, bq: int, j, bk: int):
    """Which keys of key tile j the queries of query tile i see, bool `[batch or 1, bq, bk]`, or None (all)."""
    q_pos, k_pos = i * bq + jnp.arange(bq), j * bk + jnp.arange(bk)
    parts = []
    if m.causal:
        mask = q_pos[:, None] >= k_pos[None, :]
        if m.window:
            mask = mask & (q_pos[:, None] - k_pos[None, :] < m.window)
        parts.append(mask[None])
    if m.low is not None:
        parts.append(k_pos[None, None, :] >= _rows(m.low, i, bq)[:, :, None])
    if m.ends is not None:
        parts.append(k_pos[None, None, :] < _rows(m.ends, i, bq)[:, :, None])
    if m.ids is not None:  # a shared prefix's branches (same run: same document)
        parts.append(visible(_rows(m.ids, i, bq)[:, :, None], _rows(m.ids, j, bk)[:, None, :]))
    if m.q_ids is not None:
        parts.append(visible(_rows(m.q_ids, i, bq)[:, :, None], _rows(m.kv_ids, j, bk)[:, None, :]))
    return functools.reduce(jnp.logical_and, parts) if parts else None


def _kv_range(m: _Masks, i, bq: int, bk: int, nk: int, pair):
    """Key tiles `[lo, hi)` that query tile i may see (the forward's loop bounds): up to the diagonal (`causal`) and
    the tile's greatest key end (`ends`), from its least first key (`low`) and its earliest window start; `pair`:
    the key tiles sharing ids with each query tile (`_overlapping`) or None."""
    hi = jnp.minimum(nk, ((i + 1) * bq + bk - 1) // bk) if m.causal else nk
    lo = 0
    if m.low is not None:  # kv_starts may be < 0
        lo = jnp.maximum(jnp.min(_rows(m.low, i, bq)), 0) // bk
    if m.ends is not None:
        hi = jnp.minimum(hi, (jnp.max(_rows(m.ends, i, bq)) + bk - 1) // bk)
    if m.window:  # the first key tile any query of the tile sees
        lo = jnp.maximum(lo, jnp.maximum(i * bq - m.window + 1, 0) // bk)
    if pair is not None:
        lo, hi = jnp.maximum(lo, pair[0][i]), jnp.minimum(hi, pair[1][i])
    return lo, hi


def _reach(tile_low, tile_end, first, last):
    """Query tiles `[lo, hi)` that may see each key tile of keys `[first, last]` (int32 `[n_k]` each), from each
    query tile's least first key `tile_low` and greatest key end `tile_end` (`[n_q]`): tile i may see key tile j
    only if `tile_low[i] <= last[j]` and `tile_end[i] > first[j]`. Neither need be monotone (running minima and
    maxima); the range spans every such tile. O(n_q log n_q) per key tile."""
    lo_a = jnp.searchsorted(-lax.cummin(tile_low), -last, side="left")
    hi_a = jnp.searchsorted(lax.cummin(tile_low, reverse=True), last, side="right")
    lo_e = jnp.searchsorted(lax.cummax(tile_end), first, side="right")
    hi_e = jnp.searchsorted(-lax.cummax(tile_end, reverse=True), -first, side="left")
    return jnp.maximum(lo_a, lo_e).astype(jnp.int32), jnp.minimum(hi_a, hi_e).astype(jnp.int32)


def _q_ranges(m: _Masks, bq: int, bk: int, nq: int, nk: int, sk: int):
    """Query tiles `[lo, hi)` that may see each key tile (the backward's loop bounds), int32 `[nk]` each: from the
    diagonal (`causal`), up to the last query tile whose window reaches the key tile, and those whose bounds
    (`low`, `ends`) or ids (`q_ids`) reach it."""
    j = jnp.arange(nk, dtype=jnp.int32)
    first, last = j * bk, (j + 1) * bk - 1
    lo = first // bq if m.causal else jnp.zeros_like(j)
    hi = jnp.full_like(j, nq)
    if m.q_ids is not None:
        lo_p, hi_p = _overlapping(*_tile_ends(m.q_ids, bq), *_tile_ends(m.kv_ids, bk))
        lo, hi = jnp.maximum(lo, lo_p), jnp.minimum(hi, hi_p)
    if m.window:  # past the last query tile whose window reaches the key tile's last key
        hi = jnp.minimum(hi, (last + m.window - 1) // bq + 1)
    if m.low is not None or m.ends is not None:
        b = (m.low if m.low is not None else m.ends).shape[0]
        low = jnp.zeros((nq,), jnp.int32) if m.low is None else m.low.reshape(b, nq, bq).min(axis=(0, 2))
        end = jnp.full((nq,), sk, jnp.int32) if m.ends is None else m.ends.reshape(b, nq, bq).max(axis=(0, 2))
        lo_r, hi_r = _reach(low, end, first, last)
        lo, hi = jnp.maximum(lo, lo_r), jnp.minimum(hi, hi_r)
    return lo, hi


# ------------------------------------------------------------------ blockwise forward


def blockwise_attention_fwd(q, k, v, *, causal: bool = True, block_q: int = 512, block_k: int = 512,
                            segment_ids=None, kv_segment_ids=None, window: int = 0, kv_starts=None, kv_ends=None,
                            kv_head_major: bool = False):
    """FlashAttention-2 forward (Dao 2023, arXiv 2307.08691, Alg. 1) in pure JAX; returns `(out, lse)`.

    Args:
      q: `[batch, seq, heads, head_dim]`; k, v: `[batch, kv_seq, kv_heads, head_dim]` (`kv_seq` = `seq` when
        `causal`).
      causal: mask keys after the query position.
      block_q, block_k: query / key tile lengths (may differ). Each is clamped to its sequence (`seq`, `kv_seq`) and
        must then divide it.
      segment_ids: int `[batch, seq]` or None: document masking (module docstring).
      kv_segment_ids: int `[batch, kv_seq]` or None: the keys' ids when q and k are different blocks of a sequence
        (ring attention's off-diagonal blocks); then `causal=False` and query `i` sees key `j` iff `segment_ids[i] ==
        kv_segment_ids[j]`. Both must be non-decreasing along the sequence (e.g. each token's document start): kv tiles
        whose id range misses the query tile's are skipped.
      window: 0, or a sliding window of that many positions with `causal` (query `t` sees keys `t - window + 1 ..
        t`, transformers' `sliding_window`); the key tiles wholly before every query's window are not visited.
      kv_starts: int `[batch, seq]` or None: query `t` sees key `j` only if `j >= kv_starts[t]` (key indices, any
        sign), as `jaxlong.kernels.pallas_gpu`'s: the first key of a query's document in a block of keys, or of
        the keys a chunk's query may see in a cache (`jaxlong.generation.chunked`). Combined with every other mask.
      kv_ends: int `[batch, seq]` or None: query `t` sees key `j` only if `j < kv_ends[t]` (a window in a cache
        whose order is not the prompt's, `jaxlong.generation.chunked`). The key tiles wholly before a query
        tile's least `kv_starts` or from its greatest `kv_ends` on are not visited.
      kv_head_major: k, v are `[batch, kv_heads, kv_seq, head_dim]` (a KV cache's layout, read in place).

    Returns:
      `out` with the shape and dtype of `q`; `lse` float32 `[batch, heads, seq]`. With `kv_segment_ids`,
      `kv_starts` or `kv_ends` a query that sees no key gets output 0 and lse `-inf`.

    Raises:
      ValueError: malformed shapes (q and k of different lengths with `causal`), a block size that does not divide
        its sequence, segment ids that are not `[batch, seq]` integers (or come with `causal=False`), bounds that are
        not integer `[batch, seq]`, or a window without `causal`.

    Query tiles are processed by `lax.map`; each runs an online softmax in a `lax.fori_loop` over the kv tiles its
    queries may see (`_kv_range`; tiles straddling a bound are computed and masked). Peak extra memory is O(tile^2).
    """
    keys = [jax.ShapeDtypeStruct(x.shape[:1] + x.shape[2:3] + x.shape[1:2] + x.shape[3:], x.dtype)
            for x in (k, v)] if kv_head_major else (k, v)
    (b, s, h, kvh, d), (bq, bk) = _dims(q, *keys, block_q, block_k, causal)
    m = _masks(q, keys[0], causal, window, segment_ids, kv_segment_ids, kv_starts, kv_ends)
    g, nq, nk = h // kvh, s // bq, keys[0].shape[1] // bk
    scale = 1.0 / math.sqrt(d)
    q5 = _split_heads(q, kvh)
    pair = None if m.q_ids is None else _overlapping(*_tile_ends(m.kv_ids, bk), *_tile_ends(m.q_ids, bq))

    def kv_tile(x, j):  # [b, bk, kvh, d]
        if kv_head_major:
            return jnp.swapaxes(lax.dynamic_slice_in_dim(x, j * bk, bk, axis=2), 1, 2)
        return lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1)

    def q_tile(i):
        q_i = lax.dynamic_slice_in_dim(q5, i * bq, bq, axis=1)  # [b, bq, kvh, g, d]

        def kv_step(j, carry):
            mx, l, acc = carry  # mx, l: [b, kvh, g, bq]; acc: [b, kvh, g, bq, d] (float32)
            k_j, v_j = kv_tile(k, j), kv_tile(v, j)
            sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
            mask = _tile_mask(m, i, bq, j, bk)
            if mask is not None:
                mask = mask[:, None, None]  # [b or 1, 1, 1, bq, bk]
                sc = jnp.where(mask, sc, _NEG)
            # A row may have no visible key in this tile (all _NEG, so m_new == _NEG too): the
            # explicit where keeps its exp(_NEG - _NEG) = 1 out of l and acc.
            m_new = jnp.maximum(mx, sc.max(axis=-1))
            p = jnp.exp(sc - m_new[..., None])
            if mask is not None:
                p = jnp.where(mask, p, 0.0)
            corr = jnp.exp(mx - m_new)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v_j, preferred_element_type=_F32)
            return m_new, l * corr + p.sum(axis=-1), acc * corr[..., None] + pv

        init = (_full((b, kvh, g, bq), _NEG, q, k, v), _full((b, kvh, g, bq), 0, q, k, v),
                _full((b, kvh, g, bq, d), 0, q, k, v))
        mx, l, acc = lax.fori_loop(*_kv_range(m, i, bq, bk, nk, pair), kv_step, init)
        lse_i = mx + jnp.log(l)
        if m.empty:  # rows that see no key: out 0, lse -inf
            lse_i = jnp.where(l > 0, lse_i, -jnp.inf)
            l = jnp.where(l > 0, l, 1.0)
        out_i = jnp.transpose(acc / l[..., None], (0, 3, 1, 2, 4))  # [b, bq, kvh, g, d]
        return out_i.astype(q.dtype), lse_i

    outs, lses = lax.map(q_tile, jnp.arange(nq))  # [nq, b, bq, kvh, g, d], [nq, b, kvh, g, bq]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, s, h, d)
    lse = jnp.transpose(lses, (1, 2, 3, 0, 4)).reshape(b, h, s)
    return out, lse


# ----------------------------------------------------------------- blockwise backward


def blockwise_attention_bwd(q, k, v, out, lse, dout, *, causal: bool = True,
                            block_q: int = 512, block_k: int = 512, segment_ids=None,
                            kv_segment_ids=None, window: int = 0, kv_starts=None, kv_ends=None):
    """FlashAttention-2 backward (Dao 2023, arXiv 2307.08691, Alg. 2) in pure JAX; returns `(dq, dk, dv)`.

    Args:
      q, k, v: as for `blockwise_attention_fwd` (k, v sequence-major).
      out: forward output, shape/dtype of `q`; lse: float32 `[batch, heads, seq]` from
        the forward; dout: cotangent of `out` (shape of `q`).
      causal, block_q, block_k, segment_ids, kv_segment_ids, window, kv_starts, kv_ends: must match the forward
        call (same checks); `lse` may be of more keys than `k` (ring attention's global lse), and -inf for a row
        that sees no key (its gradients are 0).

    Returns:
      `dq`, `dk`, `dv` with the shapes and dtypes of `q`, `k`, `v`; `dk` and
      `dv` are summed over the query heads of each GQA group.

    Raises:
      ValueError: as `blockwise_attention_fwd`.

    An outer `lax.scan` walks kv tiles, accumulating that tile's `dk`/`dv` in float32; an inner `lax.fori_loop`
    walks the query tiles that may see the kv tile (`_q_ranges`), recomputing `P = exp(q k^T * scale - lse)` per
    tile and adding into a float32 `dq` buffer carried through the scan. No `[seq, seq]` array is formed.
    """
    (b, s, h, kvh, d), (bq, bk) = _dims(q, k, v, block_q, block_k, causal)
    m = _masks(q, k, causal, window, segment_ids, kv_segment_ids, kv_starts, kv_ends)
    sk = k.shape[1]
    g, nq, nk = h // kvh, s // bq, sk // bk
    scale = 1.0 / math.sqrt(d)
    q5, do5 = _split_heads(q, kvh), _split_heads(dout.astype(q.dtype), kvh)
    lse4 = lse.astype(_F32).reshape(b, kvh, g, s)
    # D_i = rowsum(dO_i * O_i), [b, kvh, g, s]
    delta = jnp.einsum("bshgd,bshgd->bhgs", do5.astype(_F32),
                       _split_heads(out, kvh).astype(_F32))
    lo_tiles, hi_tiles = _q_ranges(m, bq, bk, nq, nk, sk)
    refs = (q, k, v, out, lse, dout)  # for the shard_map varying axes of the carries

    def kv_tile(dq_acc, j):
        k_j = lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)  # [b, bk, kvh, d]
        v_j = lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)

        def q_step(i, carry):
            dq_acc, dk_j, dv_j = carry
            q_i = lax.dynamic_slice_in_dim(q5, i * bq, bq, axis=1)  # [b, bq, kvh, g, d]
            do_i = lax.dynamic_slice_in_dim(do5, i * bq, bq, axis=1)
            lse_i = lax.dynamic_slice_in_dim(lse4, i * bq, bq, axis=3)  # [b, kvh, g, bq]
            delta_i = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            sc = jnp.einsum("bqhgd,bkhd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
            mask = _tile_mask(m, i, bq, j, bk)
            if mask is not None:
                sc = jnp.where(mask[:, None, None], sc, _NEG)
            p = jnp.exp(sc - lse_i[..., None])  # masked entries -> 0 (unless the row's lse is -inf)
            if m.bounded:
                p = jnp.where(mask[:, None, None], p, 0.0)
            dv_j = dv_j + jnp.einsum("bhgqk,bqhgd->bkhd", p.astype(do_i.dtype), do_i,
                                     preferred_element_type=_F32)
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_i, v_j, preferred_element_type=_F32)
            ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
            dk_j = dk_j + jnp.einsum("bhgqk,bqhgd->bkhd", ds, q_i,
                                     preferred_element_type=_F32)
            dq_i = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k_j, preferred_element_type=_F32)
            dq_old = lax.dynamic_slice_in_dim(dq_acc, i * bq, bq, axis=1)
            dq_acc = lax.dynamic_update_slice_in_dim(dq_acc, dq_old + dq_i, i * bq, axis=1)
            return dq_acc, dk_j, dv_j

        zeros = _full((b, bk, kvh, d), 0, *refs)
        dq_acc, dk_j, dv_j = lax.fori_loop(lo_tiles[j], hi_tiles[j], q_step, (dq_acc, zeros, zeros))
        return dq_acc, (dk_j.astype(k.dtype), dv_j.astype(v.dtype))

    dq_acc = _full((b, s, kvh, g, d), 0, *refs)
    dq_acc, (dks, dvs) = lax.scan(kv_tile, dq_acc, jnp.arange(nk))  # dks: [nk, b, bk, kvh, d]
    dq = dq_acc.reshape(b, s, h, d).astype(q.dtype)
    dk = jnp.moveaxis(dks, 0, 1).reshape(b, sk, kvh, d)
    dv = jnp.moveaxis(dvs, 0, 1).reshape(b, sk, kvh, d)
    return dq, dk, dv


# ------------------------------------------------------------------------ custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _blockwise(q, k, v, segment_ids, causal, block_q, block_k, window):
    return blockwise_attention_fwd(q, k, v, causal=causal, block_q=block_q,
                                   block_k=block_k, segment_ids=segment_ids, window=window)[0]


def _blockwise_vjp_fwd(q, k, v, segment_ids, causal, block_q, block_k, window):
    out, lse = blockwise_attention_fwd(q, k, v, causal=causal, block_q=block_q,
                                       block_k=block_k, segment_ids=segment_ids, window=window)
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (q, k, v, segment_ids, out, lse)  # O(seq) residuals only: no score tiles


def _blockwise_vjp_bwd(causal, block_q, block_k, window, res, dout):
    q, k, v, segment_ids, out, lse = res
    dq, dk, dv = blockwise_attention_bwd(q, k, v, out, lse, dout, causal=causal,
                                         block_q=block_q, block_k=block_k,
                                         segment_ids=segment_ids, window=window)
    return dq, dk, dv, None


_blockwise.defvjp(_blockwise_vjp_fwd, _blockwise_vjp_bwd)


def blockwise_attention(q, k, v, *, causal: bool = True, block_q: int = 512,
                        block_k: int = 512, segment_ids=None, window: int = 0):
    """Differentiable blockwise attention (`jax.custom_vjp`); returns `out`.

    Forward is `blockwise_attention_fwd`, backward `blockwise_attention_bwd`; the saved residuals are exactly `(q, k, v,
    segment_ids, out, lse)`. Works under `jit`, `lax.scan`, `shard_map` and `jax.checkpoint`. Shapes, dtypes and errors
    as for `blockwise_attention_fwd` (checked eagerly, before tracing the custom_vjp).
    """
    _, (bq, bk) = _dims(q, k, v, block_q, block_k, causal)
    segment_ids = _check_segments(segment_ids, q, causal)
    return _blockwise(q, k, v, segment_ids, bool(causal), bq, bk, check_window(window, causal))


def check_attention_block(key: str, block: int, seq: int) -> None:
    """The blockwise attention kernel's tile along the sequence: it sees the whole sequence after Ulysses'
    all-to-all, clamps the tile to it, and needs the tile to divide it (`jaxlong.kernels.blockwise`).

    Raises:
      ConfigError: `block` <= 0, or min(block, seq) does not divide `seq` (`key` names the option).
    """
    if block <= 0:
        raise ConfigError(f"{key}={block} must be a positive tile length", key=key, value=block)
    b = min(block, seq)
    if seq % b:
        raise ConfigError(
            f"{key}={block} must divide seq_len={seq} (attention sees the whole sequence after the all-to-all) or "
            f"be at least as long", key=key, value=block, keys=("seq_len",))

"""Sliding-window layers under ring attention: a halo exchange instead of the ring.

A local layer's query at position t sees the keys at `t - W + 1 .. t` only (Gemma 3, arXiv 2503.19786 section 2).
Under ring attention (`jaxlong.parallel.ring`) each ring rank r holds two half-chunks of `c = S / (2 R)` tokens in
the zigzag layout: chunk r and chunk 2R - 1 - r (token order). Every query of a half-chunk j sees its own
half-chunk (causal, within the window) and at most the W - 1 keys before it, which lie in the chunks j - 1,
j - 2, ... before it in token order: `a = ceil(h / c)` chunks for a halo of `h` rows (`h` the window less one,
rounded up to the kernel's tile). Chunk i lives on rank i (first half) when i < R, else on rank 2R - 1 - i
(second half), so at hop a:

- chunk r's predecessor r - a is rank r - a's first half (none when r < a): one `ppermute` shifting first halves
  by +a;
- chunk 2R - 1 - r's predecessor 2R - 1 - r - a is rank r + a's second half when r + a < R, otherwise rank
  2R - 1 - r - a's first half: two `ppermute`s, one of second halves, one of first halves.

So instead of circulating every rank's K/V around the ring (R - 1 steps of S/R rows), each rank receives the `h`
rows before each of its half-chunks, whole chunks from the nearer hops and the tail of the farthest
(`lax.ppermute`; a window within a half-chunk takes one hop); the transpose of the permutes sends their gradients
back. No all-to-all is involved, so the KV-head limit of Ulysses does not apply to the ring part. Each half-chunk
then runs the windowed kernel on its halo and itself (`[h + c]` keys; the halo's query rows are zeros and their
outputs dropped), the document mask given by run ids, which agree across chunks (`jaxlong.parallel.ring.run_ids`);
rows before the sequence's start are marked with the id -1, which no query has. The halo's rows farther than W - 1
from every query are masked by the window.

This is the halo exchange of Megatron-LM's open PR #5597 (`swa_p2p`), in the zigzag layout and over several hops.
`halo_attention_fwd` / `halo_attention_bwd` are the forward with its log-sum-exp and the backward from it (for ops
with their own backward, U-Pipe's stages); `halo_attention_local` is the differentiable attention built from them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxlong.core.kept import keep_attention_residuals
from jaxlong.core.mesh import RING_AXIS
from jaxlong.kernels.blockwise import blockwise_attention_bwd, blockwise_attention_fwd
from jaxlong.parallel.ring import run_ids

__all__ = ["halo_tiles", "halo_rows", "exchange_bytes", "halo_over_context", "halo_attention_fwd",
           "halo_attention_bwd", "halo_attention_local"]


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


def exchange_bytes(window: int, seq: int, context: int, heads: int, kv_heads: int, head_dim: int, itemsize: int,
                   block_q: int, block_k: int) -> tuple[int, int]:
    """Bytes one device sends in a local layer's forward over `context` (C devices, contiguous chunks of `seq / C`
    tokens), each way of meeting the window: `(halo, all_to_all)`.

    halo: the K/V rows of the window before its chunk, `2 * halo_rows * kv_heads * head_dim * itemsize` (a window
    wider than a chunk takes several hops, the same rows in all). all_to_all (Ulysses): Q, K, V in and the output back,
    the share `(C - 1) / C` of `seq / C * (2 heads + 2 max(kv_heads, C)) * head_dim * itemsize` (KV heads replicated
    up to C). The backward sends as much again either way. Both ways compute the same tiles; the halo adds its own
    rows' keys to each chunk's first tiles."""
    chunk = seq // context
    halo = 2 * halo_rows(window, chunk, block_q, block_k) * kv_heads * head_dim * itemsize
    a2a = (context - 1) * chunk * (2 * heads + 2 * max(kv_heads, context)) * head_dim * itemsize // context
    return halo, a2a


def halo_over_context(exchange: str, window: int, seq: int, context: int, heads: int, kv_heads: int, head_dim: int,
                      block_q: int, block_k: int) -> bool:
    """Whether a local layer under Ulysses (no ring) meets its window by the halo exchange over `context` rather than
    the all-to-all: `exchange` (`attention.window_exchange`) `halo`, or `auto` where `exchange_bytes` counts fewer
    bytes for the halo; never for a global layer (`window` 0), a window as long as the sequence, or one device."""
    if not 0 < window < seq or context == 1 or exchange == "all_to_all":
        return False
    if exchange == "halo":
        return True
    halo, a2a = exchange_bytes(window, seq, context, heads, kv_heads, head_dim, 1, block_q, block_k)
    return halo < a2a


def _zigzag(axis_name: str) -> bool:
    """The sequence's layout over `axis_name`: ring attention's zigzag over `ring` (two half-chunks a rank), plain
    contiguous chunks over `context` (Ulysses' sequence split, one chunk a rank)."""
    return axis_name == RING_AXIS


def _chunk(rank, slot: int, size: int):
    """The token-order index of `rank`'s chunk in `slot` (an int, or traced)."""
    return rank if slot == 0 else 2 * size - 1 - rank


def _owner(i: int, size: int, zigzag: bool) -> tuple[int, int]:
    """(rank, slot) holding chunk `i` in token order."""
    if not zigzag or i < size:
        return i, 0
    return 2 * size - 1 - i, 1


def _self_free_shift(x, pairs, r, axis_name: str):
    """`lax.ppermute` of `x` over `axis_name` by `(source, destination)` pairs; a pair (i, i) keeps rank i's own `x`
    (no send, and no permute when that is all); ranks no pair reaches get zeros."""
    own = [s for s, d in pairs if s == d]
    sends = [(s, d) for s, d in pairs if s != d]
    out = lax.ppermute(x, axis_name, sends) if sends else jnp.zeros_like(x)
    return jnp.where(r == own[0], x, out) if own else out


def _pieces(h: int, c: int) -> list[tuple[int, int]]:
    """The halo of a chunk, farthest hop first: `(hop a, rows taken from the end of chunk j - a)`."""
    hops = -(-h // c)
    return [(a, h - (hops - 1) * c if a == hops else c) for a in range(hops, 0, -1)]


def _hop(chunks, slot: int, a: int, rows: int, r, axis_name: str):
    """The last `rows` rows of the chunk `a` before this rank's chunk in `slot` (token order), from the rank and slot
    that hold it: one `ppermute` per slot it comes from; zeros where it would lie before the sequence's start."""
    size, zigzag, c = lax.axis_size(axis_name), _zigzag(axis_name), chunks[0].shape[1]
    by_slot: dict[int, list] = {}
    for dest in range(size):
        i = _chunk(dest, slot, size) - a
        if i >= 0:
            src, src_slot = _owner(i, size, zigzag)
            by_slot.setdefault(src_slot, []).append((src, dest))
    got = jnp.zeros_like(chunks[0][:, c - rows:])
    for src_slot, pairs in sorted(by_slot.items()):
        moved = _self_free_shift(chunks[src_slot][:, c - rows:], pairs, r, axis_name)
        mine = jnp.asarray([any(d == dest for _, d in pairs) for dest in range(size)])[r]
        got = moved if len(by_slot) == 1 else jnp.where(mine, moved, got)
    return got


def _halo_kv(k, v, h: int, axis_name: str):
    """The `h` K/V rows before each of this rank's chunks (token order), gathered from the ranks that hold them
    (module docstring): `((k_halo per chunk), (v_halo per chunk))`, each `[batch, h, kv_heads, head_dim]` (zeros
    before the sequence's start). Linear in k, v: its transpose (`jax.vjp`) sends the halo's gradients back."""
    r, slots = lax.axis_index(axis_name), 2 if _zigzag(axis_name) else 1
    c = k.shape[1] // slots
    out = []
    for x in (k, v):
        chunks = [x[:, q * c:(q + 1) * c] for q in range(slots)]
        out.append(tuple(jnp.concatenate([_hop(chunks, q, a, rows, r, axis_name) for a, rows in _pieces(h, c)],
                                         axis=1) for q in range(slots)))
    return tuple(out)


def _halo_ids(runs, n: int, h: int, axis_name: str):
    """Run ids `[batch, h + c]` of each of this rank's chunks' halo and itself (-1 before the sequence's start), from
    the run ids `runs` `[batch, S]` of the whole sequence in the axis's layout; `n` = rows per rank."""
    size, r, zigzag = lax.axis_size(axis_name), lax.axis_index(axis_name), _zigzag(axis_name)
    slots = 2 if zigzag else 1
    c = n // slots
    out = []
    for q in range(slots):
        parts = []
        for a, rows in _pieces(h, c):
            i = _chunk(r, q, size) - a  # the chunk `a` before, in token order
            start = jnp.where(i < size, i * n, (2 * size - 1 - i) * n + c) if zigzag else i * n  # where it lies
            ids = lax.dynamic_slice_in_dim(runs, jnp.clip(start + c - rows, 0, runs.shape[1] - rows), rows, axis=1)
            parts.append(jnp.where(i >= 0, ids, -1))
        parts.append(lax.dynamic_slice_in_dim(runs, r * n + q * c, c, axis=1))
        out.append(jnp.concatenate(parts, axis=1))
    return out


def _setup(q, window: int, block_q: int, block_k: int, segment_ids, ids_are_runs: bool, axis_name: str):
    """(halo rows h, chunk length c, tiles (tq, tk), each chunk's run ids `[batch, h + c]`)."""
    size, zigzag = lax.axis_size(axis_name), _zigzag(axis_name)
    b, n = q.shape[:2]
    c = n // 2 if zigzag else n
    h = halo_rows(window, c, block_q, block_k)
    if segment_ids is None:
        runs = jnp.zeros((b, n * size), jnp.int32)
    else:
        runs = segment_ids.astype(jnp.int32) if ids_are_runs else run_ids(segment_ids, size if zigzag else 1)
    return h, c, halo_tiles(c, block_q, block_k), _halo_ids(runs, n, h, axis_name)


def _pad(x, h: int, axis: int = 1):
    """`h` zero rows before `x` along `axis` (the halo's query rows)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (h, 0)
    return jnp.pad(x, pad)


def halo_attention_fwd(q, k, v, *, window: int, block_q: int = 512, block_k: int = 512, segment_ids=None,
                       ids_are_runs: bool = False, axis_name: str = RING_AXIS):
    """Sliding-window attention of one rank inside `jax.shard_map` over `axis_name` (module docstring), with its
    log-sum-exp.

    Args:
      q: `[batch, S/R, heads, head_dim]`, this rank's share of the sequence: over `ring` its two half-chunks in the
        zigzag layout, over `context` one contiguous chunk (all heads: no all-to-all); k, v: `[batch, S/R,
        kv_heads, head_dim]`.
      window: the local layer's window W in positions (0 < W < S; any width: wider windows take more hops).
      block_q, block_k: the blockwise kernel's tiles (clamped to divisors of the half-chunk, `halo_tiles`).
      segment_ids: int `[batch, S]` of the whole sequence in the axis's layout (zigzag over `ring`, as ring attention
        takes them), or None (each row one causal stream); `ids_are_runs`: they are run ids already.
      axis_name: `ring` (the zigzag layout) or `context` (contiguous chunks).

    Returns:
      `(out, lse)`: `[batch, S/R, heads, head_dim]` like q, and float32 `[batch, heads, S/R]`.
    """
    h, c, (tq, tk), ids = _setup(q, window, block_q, block_k, segment_ids, ids_are_runs, axis_name)
    (kh, vh) = _halo_kv(k, v, h, axis_name)
    outs, lses = [], []
    for half in range(len(ids)):
        sl = slice(half * c, (half + 1) * c)
        out, lse = blockwise_attention_fwd(
            _pad(q[:, sl], h), jnp.concatenate([kh[half], k[:, sl]], axis=1),
            jnp.concatenate([vh[half], v[:, sl]], axis=1), causal=True, block_q=tq, block_k=tk,
            segment_ids=ids[half], window=window)
        outs.append(out[:, h:])
        lses.append(lse[..., h:])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


def halo_attention_bwd(q, k, v, out, lse, dout, *, window: int, block_q: int = 512, block_k: int = 512,
                       segment_ids=None, ids_are_runs: bool = False, axis_name: str = RING_AXIS):
    """The backward of `halo_attention_fwd` from its saved `out` and `lse` (no forward is rerun; the halo's K/V are
    exchanged again, and their gradients sent back to the ranks that hold them).

    Args: as `halo_attention_fwd`, with its `out` `[batch, S/R, heads, head_dim]`, `lse` float32 `[batch, heads,
      S/R]` and the output's gradient `dout` (like q).

    Returns:
      `(dq, dk, dv)`, shaped like q, k, v.
    """
    h, c, (tq, tk), ids = _setup(q, window, block_q, block_k, segment_ids, ids_are_runs, axis_name)
    (kh, vh), pull = jax.vjp(lambda k, v: _halo_kv(k, v, h, axis_name), k, v)
    grads = []  # (dq, dk, dv) of each chunk with its halo
    for half in range(len(ids)):
        sl = slice(half * c, (half + 1) * c)
        grads.append(blockwise_attention_bwd(
            _pad(q[:, sl], h), jnp.concatenate([kh[half], k[:, sl]], axis=1),
            jnp.concatenate([vh[half], v[:, sl]], axis=1), _pad(out[:, sl], h), _pad(lse[..., sl], h, axis=-1),
            _pad(dout[:, sl], h), causal=True, block_q=tq, block_k=tk, segment_ids=ids[half], window=window))
    dk_back, dv_back = pull(tuple(tuple(g[i][:, :h] for g in grads) for i in (1, 2)))  # the halos' gradients
    dq, dk, dv = (jnp.concatenate([g[i][:, h:] for g in grads], axis=1) for i in range(3))  # the chunks'
    return dq, (dk + dk_back).astype(k.dtype), (dv + dv_back).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _halo(q, k, v, segment_ids, opts, ids_are_runs):
    return halo_attention_fwd(q, k, v, segment_ids=segment_ids, ids_are_runs=ids_are_runs, **dict(opts))[0]


def _halo_vjp_fwd(q, k, v, segment_ids, opts, ids_are_runs):
    out, lse = halo_attention_fwd(q, k, v, segment_ids=segment_ids, ids_are_runs=ids_are_runs, **dict(opts))
    out, lse = keep_attention_residuals(out, lse)  # `remat.keep_attention` may keep them
    return out, (q, k, v, segment_ids, out, lse)


def _halo_vjp_bwd(opts, ids_are_runs, res, dout):
    q, k, v, segment_ids, out, lse = res
    dq, dk, dv = halo_attention_bwd(q, k, v, out, lse, dout, segment_ids=segment_ids, ids_are_runs=ids_are_runs,
                                    **dict(opts))
    return dq, dk, dv, None


_halo.defvjp(_halo_vjp_fwd, _halo_vjp_bwd)


def halo_attention_local(q, k, v, *, window: int, block_q: int = 512, block_k: int = 512, segment_ids=None,
                         ids_are_runs: bool = False, axis_name: str = RING_AXIS) -> jax.Array:
    """Differentiable sliding-window attention of one rank inside `jax.shard_map` over `axis_name` (`ring` or
    `context`): the forward of `halo_attention_fwd`, the backward `halo_attention_bwd` (arguments as theirs).

    Returns:
      `[batch, S/R, heads, head_dim]`, like q.
    """
    opts = tuple(sorted(dict(window=window, block_q=block_q, block_k=block_k, axis_name=axis_name).items()))
    return _halo(q, k, v, segment_ids, opts, ids_are_runs)

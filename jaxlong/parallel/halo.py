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

from jaxlong.core.mesh import RING_AXIS
from jaxlong.kernels.blockwise import blockwise_attention_bwd, blockwise_attention_fwd
from jaxlong.parallel.ring import run_ids

__all__ = ["halo_tiles", "halo_rows", "halo_attention_fwd", "halo_attention_bwd", "halo_attention_local"]


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


def _self_free_shift(x, pairs, r):
    """`lax.ppermute` of `x` over the ring by `(source, destination)` pairs; a pair (i, i) keeps rank i's own `x`
    (no send, and no permute when that is all); ranks no pair reaches get zeros."""
    own = [s for s, d in pairs if s == d]
    sends = [(s, d) for s, d in pairs if s != d]
    out = lax.ppermute(x, RING_AXIS, sends) if sends else jnp.zeros_like(x)
    return jnp.where(r == own[0], x, out) if own else out


def _pieces(h: int, c: int) -> list[tuple[int, int]]:
    """The halo of a half-chunk, farthest hop first: `(hop a, rows taken from the end of chunk j - a)`."""
    hops = -(-h // c)
    return [(a, h - (hops - 1) * c if a == hops else c) for a in range(hops, 0, -1)]


def _halo_kv(k, v, h: int):
    """The `h` K/V rows before each of this rank's two half-chunks (token order), gathered from the ranks that hold
    them (module docstring): `((k_halo_0, k_halo_1), (v_halo_0, v_halo_1))`, each `[batch, h, kv_heads, head_dim]`
    (zeros before the sequence's start). Linear in k, v: its transpose (`jax.vjp`) sends the halo's gradients back."""
    ring, r = lax.axis_size(RING_AXIS), lax.axis_index(RING_AXIS)
    c = k.shape[1] // 2
    out = []
    for x in (k, v):
        first, second = x[:, :c], x[:, c:]
        halves = ([], [])
        for a, rows in _pieces(h, c):
            tail = slice(c - rows, c)
            halves[0].append(_self_free_shift(first[:, tail], [(s, s + a) for s in range(ring - a)], r))
            from_second = _self_free_shift(second[:, tail], [(s, s - a) for s in range(a, ring)], r)
            from_first = _self_free_shift(first[:, tail], [(s, 2 * ring - 1 - a - s) for s in range(ring)
                                                           if 0 <= 2 * ring - 1 - a - s < ring], r)
            halves[1].append(jnp.where(r + a < ring, from_second, from_first))
        out.append(tuple(jnp.concatenate(p, axis=1) for p in halves))
    return tuple(out)


def _halo_ids(runs, n: int, h: int):
    """Run ids `[batch, h + c]` of each half-chunk's halo and itself (-1 before the sequence's start), from the run
    ids `runs` `[batch, S]` of the whole sequence in the zigzag layout; `n` = S / R rows per rank."""
    ring, r = lax.axis_size(RING_AXIS), lax.axis_index(RING_AXIS)
    c = n // 2
    out = []
    for half, j in enumerate((r, 2 * ring - 1 - r)):  # the half-chunk's index in token order
        parts = []
        for a, rows in _pieces(h, c):
            i = j - a
            slot = jnp.where(i < ring, i * n, (2 * ring - 1 - i) * n + c)  # where chunk i starts in `runs`
            ids = lax.dynamic_slice_in_dim(runs, jnp.clip(slot + c - rows, 0, runs.shape[1] - rows), rows, axis=1)
            parts.append(jnp.where(i >= 0, ids, -1))
        parts.append(lax.dynamic_slice_in_dim(runs, r * n + half * c, c, axis=1))
        out.append(jnp.concatenate(parts, axis=1))
    return out


def _setup(q, window: int, block_q: int, block_k: int, segment_ids, ids_are_runs: bool):
    """(halo rows h, tiles (tq, tk), each half-chunk's run ids `[batch, h + c]`)."""
    ring = lax.axis_size(RING_AXIS)
    b, n = q.shape[:2]
    c = n // 2
    h = halo_rows(window, c, block_q, block_k)
    if segment_ids is None:
        runs = jnp.zeros((b, n * ring), jnp.int32)
    else:
        runs = segment_ids.astype(jnp.int32) if ids_are_runs else run_ids(segment_ids, ring)
    return h, halo_tiles(c, block_q, block_k), _halo_ids(runs, n, h)


def _pad(x, h: int, axis: int = 1):
    """`h` zero rows before `x` along `axis` (the halo's query rows)."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (h, 0)
    return jnp.pad(x, pad)


def halo_attention_fwd(q, k, v, *, window: int, block_q: int = 512, block_k: int = 512, segment_ids=None,
                       ids_are_runs: bool = False):
    """Sliding-window attention of one ring rank inside `jax.shard_map` over the `ring` axis (module docstring),
    with its log-sum-exp.

    Args:
      q: `[batch, S/R, heads, head_dim]`, this rank's two half-chunks in the zigzag layout; k, v: `[batch, S/R,
        kv_heads, head_dim]`.
      window: the local layer's window W in positions (0 < W < S; any width: wider windows take more hops).
      block_q, block_k: the blockwise kernel's tiles (clamped to divisors of the half-chunk, `halo_tiles`).
      segment_ids: int `[batch, S]` of the whole sequence in the zigzag layout (as ring attention takes them), or
        None (each row one causal stream); `ids_are_runs`: they are run ids already.

    Returns:
      `(out, lse)`: `[batch, S/R, heads, head_dim]` like q, and float32 `[batch, heads, S/R]`.
    """
    h, (tq, tk), ids = _setup(q, window, block_q, block_k, segment_ids, ids_are_runs)
    c = q.shape[1] // 2
    (kh, vh) = _halo_kv(k, v, h)
    outs, lses = [], []
    for half in range(2):
        sl = slice(half * c, (half + 1) * c)
        out, lse = blockwise_attention_fwd(
            _pad(q[:, sl], h), jnp.concatenate([kh[half], k[:, sl]], axis=1),
            jnp.concatenate([vh[half], v[:, sl]], axis=1), causal=True, block_q=tq, block_k=tk,
            segment_ids=ids[half], window=window)
        outs.append(out[:, h:])
        lses.append(lse[..., h:])
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=-1)


def halo_attention_bwd(q, k, v, out, lse, dout, *, window: int, block_q: int = 512, block_k: int = 512,
                       segment_ids=None, ids_are_runs: bool = False):
    """The backward of `halo_attention_fwd` from its saved `out` and `lse` (no forward is rerun; the halo's K/V are
    exchanged again, and their gradients sent back to the ranks that hold them).

    Args: as `halo_attention_fwd`, with its `out` `[batch, S/R, heads, head_dim]`, `lse` float32 `[batch, heads,
      S/R]` and the output's gradient `dout` (like q).

    Returns:
      `(dq, dk, dv)`, shaped like q, k, v.
    """
    h, (tq, tk), ids = _setup(q, window, block_q, block_k, segment_ids, ids_are_runs)
    c = q.shape[1] // 2
    (kh, vh), pull = jax.vjp(lambda k, v: _halo_kv(k, v, h), k, v)
    dq, dk, dv, dkh, dvh = [], [], [], [], []
    for half in range(2):
        sl = slice(half * c, (half + 1) * c)
        g = blockwise_attention_bwd(
            _pad(q[:, sl], h), jnp.concatenate([kh[half], k[:, sl]], axis=1),
            jnp.concatenate([vh[half], v[:, sl]], axis=1), _pad(out[:, sl], h), _pad(lse[..., sl], h, axis=-1),
            _pad(dout[:, sl], h), causal=True, block_q=tq, block_k=tk, segment_ids=ids[half], window=window)
        dq.append(g[0][:, h:])
        dk.append(g[1][:, h:])
        dv.append(g[2][:, h:])
        dkh.append(g[1][:, :h])
        dvh.append(g[2][:, :h])
    dk_back, dv_back = pull((tuple(dkh), tuple(dvh)))
    cat = functools.partial(jnp.concatenate, axis=1)
    return cat(dq), (cat(dk) + dk_back).astype(k.dtype), (cat(dv) + dv_back).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _halo(q, k, v, segment_ids, opts, ids_are_runs):
    return halo_attention_fwd(q, k, v, segment_ids=segment_ids, ids_are_runs=ids_are_runs, **dict(opts))[0]


def _halo_vjp_fwd(q, k, v, segment_ids, opts, ids_are_runs):
    out, lse = halo_attention_fwd(q, k, v, segment_ids=segment_ids, ids_are_runs=ids_are_runs, **dict(opts))
    return out, (q, k, v, segment_ids, out, lse)


def _halo_vjp_bwd(opts, ids_are_runs, res, dout):
    q, k, v, segment_ids, out, lse = res
    dq, dk, dv = halo_attention_bwd(q, k, v, out, lse, dout, segment_ids=segment_ids, ids_are_runs=ids_are_runs,
                                    **dict(opts))
    return dq, dk, dv, None


_halo.defvjp(_halo_vjp_fwd, _halo_vjp_bwd)


def halo_attention_local(q, k, v, *, window: int, block_q: int = 512, block_k: int = 512, segment_ids=None,
                         ids_are_runs: bool = False) -> jax.Array:
    """Differentiable sliding-window attention of one ring rank inside `jax.shard_map` over the `ring` axis: the
    forward of `halo_attention_fwd`, the backward `halo_attention_bwd` (arguments as theirs).

    Returns:
      `[batch, S/R, heads, head_dim]`, like q.
    """
    opts = tuple(sorted(dict(window=window, block_q=block_q, block_k=block_k).items()))
    return _halo(q, k, v, segment_ids, opts, ids_are_runs)

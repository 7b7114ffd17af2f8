"""Merging partial attentions: the softmax over a union of disjoint key sets from each set's output and
log-sum-exp, written once.

Attention over keys split into disjoint sets K_1..K_n is recovered exactly from each set's normalised output o_i and
log-sum-exp l_i (FlashAttention's online softmax, Dao et al. 2022, arXiv 2205.14135, section 3.1; Flash-Decoding,
Dao et al. 2023; ring attention, Liu et al. 2023, arXiv 2310.01889):

    l = log sum_i exp(l_i),    o = sum_i exp(l_i - l) o_i.

A set a query cannot see has l_i = -inf (or `NEG`, a finite stand-in that keeps exp(l_i - max) from NaN when every
set is empty) and weight 0; a query that sees no key anywhere gets output 0. Three callers: ring attention merges
each ring step's block into its running output (`merge_into`, the kernels' layout), the decode step merges the
prompt cache's part with the generated tokens' (`merge`), and the cache paths merge the shards' parts across the
sequence axes (`merge_across`, inside `jax.shard_map`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["NEG", "add_rounded", "merge", "merge_across", "merge_into", "normalise"]

NEG = -1e30  # a masked score or an empty set's lse: finite, so exp(NEG - max) = 0, never NaN


def normalise(o: jax.Array, mx: jax.Array, total: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A partial from its online-softmax statistics: `(o / total, mx + log total)` for the unnormalised output `o`
    `[..., head_dim]`, the running maximum `mx` and sum `total` `[...]` (float32); `(0, NEG)` where `total` is 0."""
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    return o / safe[..., None], jnp.where(seen, mx + jnp.log(safe), NEG)


def merge(parts) -> tuple[jax.Array, jax.Array]:
    """The softmax over the union of disjoint key sets from their partials `[(out, lse), ...]`: out float32
    `[..., head_dim]` (normalised over its own set), lse `[...]` (`NEG` or -inf where the set is empty). Returns the
    merged `(out, lse)`, `(0, NEG)` for a query that sees no key."""
    top = functools.reduce(jnp.maximum, [lse for _, lse in parts])
    ws = [jnp.where(lse > NEG / 2, jnp.exp(lse - top), 0.0) for _, lse in parts]
    out = sum(w[..., None] * o for w, (o, _) in zip(ws, parts))
    return normalise(out, top, sum(ws))


def merge_across(out: jax.Array, lse: jax.Array, axes: tuple[str, ...], scatter_axis: int | None = None):
    """`merge` of the partials that the devices along the mesh `axes` hold (inside `jax.shard_map`): one `pmax` of
    the lse and one `psum` of the weighted outputs and weights, or a `psum_scatter` along `scatter_axis` of out
    (each device keeps its slice of the queries; lse's axis is the same). Returns `(out, lse)` as `merge`."""
    top = jax.lax.pmax(lse, axes)
    w = jnp.where(lse > NEG / 2, jnp.exp(lse - top), 0.0)
    if scatter_axis is None:
        return normalise(jax.lax.psum(out * w[..., None], axes), top, jax.lax.psum(w, axes))
    o = jax.lax.psum_scatter(out * w[..., None], axes, scatter_dimension=scatter_axis, tiled=True)
    total = jax.lax.psum_scatter(w, axes, scatter_dimension=scatter_axis, tiled=True)
    top = jax.lax.dynamic_slice_in_dim(top, _index(axes) * total.shape[scatter_axis], total.shape[scatter_axis],
                                       axis=scatter_axis)
    return normalise(o, top, total)


def _index(axes: tuple[str, ...]) -> jax.Array:
    """This device's index along the flattened `axes` (major first)."""
    i = jnp.int32(0)
    for a in axes:
        i = i * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return i


def merge_into(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array):
    """Ring attention's running merge in the kernels' layout: out float32 `[b, s, h, d]`, lse float32 `[b, h, s]`.
    `lse_a` is finite (the diagonal block's: every query sees itself); `lse_b` may be -inf (a query that sees no key
    of block b), whose weight is then 0."""
    lse = jnp.logaddexp(lse_a, lse_b)
    wa = jnp.swapaxes(jnp.exp(lse_a - lse), 1, 2)[..., None]
    wb = jnp.swapaxes(jnp.exp(lse_b - lse), 1, 2)[..., None]
    return wa * out_a + wb * out_b.astype(jnp.float32), lse


def add_rounded(total: jax.Array, part: jax.Array) -> jax.Array:
    """`total + part` added in float32 and rounded to `total`'s dtype: how sequence-sized gradient accumulators sum
    their contributions (ring attention's, U-Pipe's over a KV group's stages, the cuDNN kernel's over head calls)."""
    return (total.astype(jnp.float32) + part.astype(jnp.float32)).astype(total.dtype)

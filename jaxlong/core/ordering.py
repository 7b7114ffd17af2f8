"""Values that XLA can neither constant-fold, hoist out of a loop, nor compute before a given dependency.

Long-context memory is lost less to the tensors an algorithm needs than to buffers that live longer than
they should. Two compiler habits do that to the ops in this package:

- A `jnp.zeros` accumulator or output buffer inside a loop body (the decoder-layer scan) is loop-invariant,
  so while-loop-invariant code motion hoists the broadcast out of the loop, and every iteration copies it:
  one `[S/C, hidden]`-sized buffer stays live across the whole scan, plus the per-iteration copy.
- A broadcast has no inputs, so the scheduler is free to materialize it early, e.g. a backward-pass
  accumulator allocated during the forward pass and kept alive through it.

`zeros_after(dep, ...)` makes the zeros a broadcast of a scalar computed from `dep` and the device index
(`lax.axis_index`, which is not a compile-time constant under SPMD), selected away by a condition that is
always false at run time. The compiler can prove neither, so the buffer is created after `dep`, inside the
loop that computes `dep`, and its values are exactly zero (NaN or Inf in `dep` cannot leak: `where`
selects, it does not multiply). `opaque_one` is the same trick for a multiplicative 1 (see
`jaxlong.parallel.upipe._backward`). Both need the mesh axes of the enclosing `jax.shard_map` (by default the axes
`dep` varies over); outside `shard_map` they return plain constants.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def varying_axes(*xs: jax.Array) -> tuple:
    """The `jax.shard_map` mesh axes any of `xs` varies over (sorted; () outside shard_map)."""
    axes = set()
    for x in xs:
        t = jax.typeof(x)
        mat = getattr(t, "manual_axis_type", None)
        axes |= set(mat.varying if mat is not None else getattr(t, "vma", ()))
    return tuple(sorted(axes))


def _opaque_scalar(deps: tuple, value: float, dtype, axes: tuple) -> jax.Array:
    """`value` as a `dtype` scalar that depends on every array in `deps` and on the device index over `axes`."""
    never = jax.lax.axis_index(axes) < 0
    first = sum(d.reshape(-1)[0].astype(dtype) for d in deps)
    return jnp.where(never, first, jnp.asarray(value, dtype))


def opaque_one(dep: jax.Array, dtype, axes: tuple | None = None) -> jax.Array:
    """A scalar 1 of `dtype` that is only known at run time and only after `dep` is computed.

    Args:
      dep: any array (only its first element is read).
      dtype: dtype of the result.
      axes: mesh axis names of the enclosing `jax.shard_map`; default: those `dep` varies over.
    """
    axes = varying_axes(dep) if axes is None else axes
    return _opaque_scalar((dep,), 1, dtype, axes) if axes else jnp.ones((), dtype)


def zeros_after(dep: jax.Array, shape: tuple, dtype, axes: tuple | None = None, value: float = 0) -> jax.Array:
    """`jnp.full(shape, value, dtype)` (zeros by default) that the compiler cannot hoist out of the loop
    computing `dep` nor materialize before `dep` exists. Inside `jax.shard_map` (non-empty `axes`) the
    result varies over `axes`, as a scan carry there must; with `axes=()` it is a plain `jnp.full`.

    Args:
      dep: an array computed just before the buffer is needed, or a tuple of arrays: the buffer comes after
        all of them (only their first elements are read).
      shape, dtype: of the result.
      axes: mesh axis names of the enclosing `jax.shard_map`, () for none; default: those `dep` varies over.
      value: the fill value.
    """
    deps = dep if isinstance(dep, (tuple, list)) else (dep,)
    axes = varying_axes(*deps) if axes is None else axes
    if not axes:
        return jnp.full(shape, value, dtype)
    return jnp.broadcast_to(_opaque_scalar(deps, value, dtype, axes), shape)


@jax.custom_vjp
def grads_together(x, w):
    """The identity on `(x, w)` whose backward releases x's cotangent only together with w's.

    For a weight used once near the end of the forward pass (the output head): its gradient is complete as soon
    as the loss's backward is done, but the compiler may keep the unreduced `[hidden, vocab]` gradient until the
    end of the step and reduce-scatter it there, holding it (1 GiB in bf16 for a 128K vocabulary) through the
    backward of every layer. Passing the hidden states and the FSDP-sharded weight through this function makes
    the layers' backward wait for the weight's reduced gradient (`lax.optimization_barrier` on both cotangents),
    so the full-size one is freed first. Values and gradients are unchanged.
    """
    return x, w


def _together_fwd(x, w):
    return (x, w), None


def _together_bwd(_, cts):
    return tuple(jax.lax.optimization_barrier(cts))


grads_together.defvjp(_together_fwd, _together_bwd)

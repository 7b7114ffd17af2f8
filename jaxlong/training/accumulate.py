"""Gradient accumulation, the one for every objective: a global batch as N micro-batches in a `lax.scan`, only one
micro-batch's activations live at a time (as Levanter's `microbatched`).

An objective (`jaxlong.objectives.base.Objective`) gives loss *sums* and a denominator. Normalised over the batch
(`normalize = "batch"`), the denominator is counted once on the whole accumulated batch, before the scan, so the
result equals one big batch's whatever each micro-batch holds (micro-batches with fewer counted tokens or pairs
weigh each of them alike); normalised per micro-batch (`"micro"`), each micro-batch's sums are divided by its own
denominator and the N means averaged. Gradients accumulate in the parameters' dtype and sharding (FSDP:
reduce-scattered per micro-batch).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.core.mesh import BATCH_AXES, seq_axes
from jaxlong.objectives.base import Objective

__all__ = ["micro_batches", "loss_and_grads"]


def micro_batches(batch: dict, n: int, mesh: jax.sharding.Mesh) -> dict:
    """Split a global batch (every leaf `[B, seq, ...]`) into `n` micro-batches `[n, B / n, seq, ...]`.

    Micro-batch j holds rows j, j + n, j + 2n, ...: with the batch dimension sharded over data x fsdp, the
    reshape `[B] -> [B / n, n]` keeps each device's rows on it, so the split moves no data between devices
    (it needs `B / n` divisible by data x fsdp, checked by config validation for `grad_accum`). Rows stay whole,
    so a row's documents or pairs stay together."""

    def split(x):
        x = x.reshape(x.shape[0] // n, n, *x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        spec = P(None, BATCH_AXES, seq_axes(mesh), *([None] * (x.ndim - 3)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def loss_and_grads(objective: Objective, params: dict, batch: dict, n: int, graphdef, rt) -> tuple:
    """The objective's loss over a global batch, its gradient and its metrics, the batch run as `n` micro-batches.

    Args:
      objective: the `Objective`.
      params: the parameters (FSDP-sharded).
      batch: the global batch, `[batch, seq]` arrays in the steps' input layout (`jaxlong.core.batch.put_batch`).
      n: micro-batches (`grad_accum`); `batch`'s rows must divide into them over data x fsdp.
      graphdef, rt: the model's graph and `jaxlong.models.llama.Runtime`.

    Returns:
      `(loss [] float32, grads like params, metrics)`: the metrics of `objective.metrics` from the summed metric sums
      and the batch's denominator.
    """
    mesh = rt.mesh
    total = jnp.maximum(objective.denominator(batch, mesh), 1.0)

    def scaled(p, mb, denominator):
        loss, sums = objective.sums(p, mb, graphdef, rt)
        return loss / denominator, sums

    grad = jax.value_and_grad(scaled, has_aux=True)
    if n == 1:
        (loss, sums), grads = grad(params, batch, total)
        return loss, grads, objective.metrics(sums, total, batch)

    def body(carry, mb):
        d = total if objective.normalize == "batch" else jnp.maximum(objective.denominator(mb, mesh), 1.0) * n
        (l, s), g = grad(params, mb, d)
        return jax.tree.map(jnp.add, carry, (l, s, g)), None

    zeros = (jnp.zeros((), jnp.float32), {k: jnp.zeros(shape, jnp.float32) for k, shape in objective.sum_shapes().items()},
             jax.tree.map(jnp.zeros_like, params))
    (loss, sums, grads), _ = jax.lax.scan(body, zeros, micro_batches(batch, n, mesh))
    return loss, grads, objective.metrics(sums, total, batch)

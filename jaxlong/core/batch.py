"""The input layout every step takes its batches in: `put_batch`, the one place a host batch goes onto the mesh.

Batch over data x fsdp, sequence over ring x context, and with `mesh.ring` > 1 the sequence already in ring
attention's zigzag order (`zigzag_order`: permuted on the host, so a jitted step has no permutation and no
replicated batch array; Liu et al., arXiv 2310.01889, with the zigzag load balance of `zigzag_ring_flash_attn`).
`natural_order` takes per-token results back. Several processes: each builds the rows its devices hold
(`process_rows`: its share of the rows when data x fsdp spans the processes, every row when only ring or context
does) and places only its devices' blocks (`device_block`), so any mesh axis may span the processes and the global
batch is the same whatever their number. The train, eval, per-token and generation steps all take this layout.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxlong.core.mesh import RING_AXIS, axis_size, batch_spec, seq_shards

__all__ = ["zigzag_order", "batch_sharding", "process_rows", "device_block", "put_batch", "natural_order"]


def zigzag_order(seq_len: int, ring: int) -> np.ndarray:
    """Original token position of each slot of the zigzag layout, `[seq_len]` int32.

    Slot block r (tokens `[r*S/R, (r+1)*S/R)`, what ring rank r holds) is chunk r followed by chunk
    2R-1-r of the 2R chunks of S/(2R) tokens. `ring == 1` is the identity.

    Raises:
      ValueError: `seq_len` not divisible by 2 * ring (when ring > 1).
    """
    if ring == 1:
        return np.arange(seq_len, dtype=np.int32)
    if seq_len % (2 * ring):
        raise ValueError(f"zigzag layout: sequence length {seq_len} must be divisible by 2*ring = {2 * ring}")
    c = seq_len // (2 * ring)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * ring, c)
    order = np.stack([chunks[:ring], chunks[ring:][::-1]], axis=1)  # [R, 2, c]
    return order.reshape(seq_len)


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """The sharding of every `[batch, seq]` entry of a step's batch: batch over data x fsdp, sequence over
    ring x context (`jaxlong.core.mesh.batch_spec`)."""
    return NamedSharding(mesh, batch_spec())


def process_rows(mesh: jax.sharding.Mesh, global_batch: int, process: int | None = None,
                 process_of=lambda d: d.process_index) -> np.ndarray:
    """The rows of a `[global_batch, seq]` batch that the devices of one process hold under `batch_sharding`:
    sorted global row indices, int64.

    The rows are split over the batch axes (data x fsdp) only: when those span the processes each process holds
    its share of the rows; when only sequence axes (ring, context) span them every process holds every row and
    places only its own sequence slices (`put_batch`).

    Args:
      mesh: the `data x fsdp x ring x context` mesh.
      global_batch: rows of the global batch (divisible by data x fsdp, checked by config validation).
      process: the process (default: this one, `jax.process_index()`).
      process_of: `device -> process` (default: the device's own; tests simulate several processes with it).
    """
    process = jax.process_index() if process is None else process
    index = batch_sharding(mesh).devices_indices_map((global_batch, seq_shards(mesh)))
    rows = {r for device, idx in index.items() if process_of(device) == process for r in range(global_batch)[idx[0]]}
    return np.array(sorted(rows), np.int64)


def device_block(arr: np.ndarray, index: tuple, rows: np.ndarray | None = None, global_batch: int = 0) -> np.ndarray:
    """The block `index` (one device's slices of the global `[global_batch, seq, ...]` array) of a host array `arr`
    that holds the global rows `rows` (sorted; None: every row, `arr` is the global array).

    Raises:
      ValueError: `arr` lacks a row of the block.
    """
    if rows is None:
        return arr[index]
    want = np.arange(global_batch)[index[0]]
    at = np.minimum(np.searchsorted(rows, want), max(rows.size - 1, 0))
    if rows.size == 0 or np.any(rows[at] != want):
        raise ValueError(f"the host batch holds rows {rows.tolist()}, not the rows {want.tolist()} that a device of "
                         f"this process holds")
    return arr[(at, *index[1:])]


def put_batch(batch: dict, mesh: jax.sharding.Mesh, rows: np.ndarray | None = None,
              global_batch: int | None = None) -> dict:
    """Put a host batch on the mesh in the input layout of the train, eval and per-token stats steps.

    With `mesh.ring` > 1 each `[batch, seq, ...]` array is first permuted on the host into ring attention's
    zigzag order (`zigzag_order`, arXiv 2310.01889 with the zigzag load balance of
    `zigzag_ring_flash_attn`): ring rank r then receives its chunks r and 2R-1-r directly. Then every array is
    placed with `batch_sharding(mesh)` by `jax.make_array_from_callback`: each device of this process receives its
    block (its rows, its sequence slice), without a host gather and whatever axes span the processes.

    Args:
      batch: dict of numpy arrays `[rows, seq_len, ...]` (int32 tokens, targets, positions, segment ids,
        float32 mask, any other keys alike).
      mesh: the `data x fsdp x ring x context` mesh.
      rows: the global row indices that `batch`'s rows are, sorted (training: `process_rows`, which the data
        iterator builds, `jaxlong.data.batch_iterator`); they must include every row this process's devices hold.
        None: `batch` is the whole global batch, the same on every process (validation, passkey).
      global_batch: rows of the global batch when `rows` is given.

    Returns:
      dict of global `jax.Array`s `[global_batch, seq_len, ...]` with the same keys and dtypes.

    Raises:
      ValueError: an array's shape cannot be sharded over the mesh (the message names the key), its sequence
        length is not divisible by 2 * mesh.ring, or `batch` lacks rows this process's devices hold.
    """
    sharding = batch_sharding(mesh)
    ring = axis_size(mesh, RING_AXIS)
    if rows is not None:
        rows = np.asarray(rows, np.int64)
        if global_batch is None:
            raise ValueError("put_batch: rows given without global_batch")
    out = {}
    for k, v in batch.items():
        arr = np.asarray(v)
        if rows is not None and arr.shape[0] != rows.size:
            raise ValueError(f"batch[{k!r}] has {arr.shape[0]} rows but rows names {rows.size}")
        global_shape = (arr.shape[0] if rows is None else global_batch, *arr.shape[1:])
        try:
            sharding.shard_shape(global_shape)
        except Exception as e:  # noqa: BLE001 - re-raised with the key
            raise ValueError(f"batch[{k!r}] of shape {global_shape} cannot be sharded by {sharding.spec} over "
                             f"mesh {dict(mesh.shape)}: {e}") from e
        if ring > 1:
            arr = np.ascontiguousarray(arr[:, zigzag_order(arr.shape[1], ring)])
        out[k] = jax.make_array_from_callback(global_shape, sharding,
                                              lambda index, a=arr: device_block(a, index, rows, global_batch))
    return out


def natural_order(x: np.ndarray, mesh: jax.sharding.Mesh) -> np.ndarray:
    """A per-token result `[batch, seq, ...]` of a step (host array, in the input layout of `put_batch`) back
    in token order: the inverse of the zigzag permutation when `mesh.ring` > 1, else `x` itself."""
    ring = axis_size(mesh, RING_AXIS)
    x = np.asarray(x)
    if ring == 1:
        return x
    out = np.empty_like(x)
    out[:, zigzag_order(x.shape[1], ring)] = x
    return out

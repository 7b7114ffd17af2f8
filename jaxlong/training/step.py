"""The train state, the optimizer, the step's input layout and the jitted train step (loss, gradients, AdamW).

The state is a plain dict `{'step': int32 [], 'params': {...}, 'opt_state': optax state}`; parameters,
gradients and optimizer moments share the FSDP sharding of `jaxlong.core.mesh.tree_shardings`.

Input layout: every step that takes a batch (train, eval, per-token stats) takes it from `put_batch`, the one
place a host batch goes onto the mesh: batch over data x fsdp, sequence over ring x context, and with
`mesh.ring` > 1 the sequence already in ring attention's zigzag order (permuted on the host, so the jitted
step has no permutation and no replicated batch array). `natural_order` takes per-token results back.
Several processes: each builds the rows its devices hold (`process_rows`: its share of the rows when data x fsdp
spans the processes, every row when only ring or context does) and places only its devices' blocks, so any mesh
axis may span the processes and the global batch is the same whatever their number.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import Config, schedule_length
from jaxlong.core.mesh import (
    BATCH_AXES,
    RING_AXIS,
    axis_size,
    batch_spec,
    replicated,
    seq_axes,
    seq_shards,
    tree_shardings,
)
from jaxlong.layers import loss as loss_lib
from jaxlong.layers.tiled import default_loss_tile, tiled_loss_sum
from jaxlong.models import llama as model_lib
from jaxlong.parallel.ring import zigzag_order
from jaxlong.training import preference


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax AdamW behind global-norm clipping, with linear warmup then cosine decay to `lr * min_lr_ratio`, from
    global step `optim.schedule_start` (0; a recipe's stage starts its own) to `steps`."""
    o = cfg.optim
    stage_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=schedule_length(cfg.steps - o.schedule_start, o.warmup_steps, o.decay_steps),
        end_value=o.lr * o.min_lr_ratio,
    )
    if o.schedule_start:  # a recipe's stage: its own warmup and decay from its first step
        def schedule(count):
            return stage_schedule(jnp.maximum(count - o.schedule_start, 0))
    else:
        schedule = stage_schedule
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm) if o.clip_norm is not None else optax.identity(),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )
    return tx, schedule


def loss_sum_fn(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> tuple[jax.Array, jax.Array]:
    """Next-token cross-entropy *sum* (nats, float32) and valid-token count of `batch` (`inputs`, `targets`,
    `mask`, each `[batch, seq]`; other keys are passed along untouched); over sequence tiles when `tiling.loss`.
    The batch is in the step's input layout (`put_batch`: with `mesh.ring` > 1 its sequence is in ring
    attention's zigzag order, all of its `[batch, seq]` arrays alike, so the sum is that of the natural order).

    Packed documents: `positions` `[batch, seq]` (RoPE) and `segment_ids` `[batch, seq]` (document masking,
    0 = padding), when present; the segment ids are used only with `data.packing=documents` (with `concat` the
    sequence is one causal stream). Targets never cross a document boundary and padding is masked: the data
    pipeline builds them per document (`jaxlong.data`).

    Sums, not means, so that several batches (micro-batches, validation batches) combine exactly:
    mean = total sum / total count."""
    segment_ids = batch.get("segment_ids") if rt.cfg.data.packing == "documents" else None
    hidden, head = model_lib.forward(graphdef, params, batch["inputs"], rt, batch.get("positions"), segment_ids)
    tiling = rt.cfg.tiling
    if tiling.loss:
        b, s = batch["targets"].shape
        s_local = s // seq_shards(rt.mesh)
        b_local = max(b // (rt.mesh.shape["data"] * rt.mesh.shape["fsdp"]), 1)
        tile = tiling.loss_tile or default_loss_tile(s_local, head.shape[-1], batch=b_local)
        return tiled_loss_sum(hidden, head, batch["targets"], batch["mask"], tile=tile, mesh=rt.mesh)
    mask = loss_lib.effective_mask(batch["targets"], batch["mask"])  # IGNORE_INDEX targets left out, as tiled
    return jnp.sum(loss_lib.token_losses(hidden, head, batch["targets"]) * mask), jnp.sum(mask)


def loss_fn(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> jax.Array:
    """Mean next-token cross-entropy (nats/token) over the valid tokens of `batch`: `loss_sum_fn`'s
    sum / max(count, 1)."""
    loss_sum, count = loss_sum_fn(params, batch, graphdef, rt)
    return loss_sum / jnp.maximum(count, 1.0)


def micro_batches(batch: dict, n: int, mesh: jax.sharding.Mesh) -> dict:
    """Split a global batch (every leaf `[B, seq, ...]`) into `n` micro-batches `[n, B / n, seq, ...]`.

    Micro-batch j holds rows j, j + n, j + 2n, ...: with the batch dimension sharded over data x fsdp, the
    reshape `[B] -> [B / n, n]` keeps each device's rows on it, so the split moves no data between devices
    (it needs `B / n` divisible by data x fsdp, checked by config validation for `grad_accum`)."""

    def split(x):
        x = x.reshape(x.shape[0] // n, n, *x.shape[1:])
        x = jnp.swapaxes(x, 0, 1)
        spec = P(None, BATCH_AXES, seq_axes(mesh), *([None] * (x.ndim - 3)))
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(split, batch)


def accumulated_loss_and_grads(params: dict, batch: dict, graphdef, rt: model_lib.Runtime, n: int):
    """Mean loss and its gradient over a global batch run as `n` micro-batches in a `lax.scan`
    (gradient accumulation): only one micro-batch's activations are live at a time.

    The loss is normalized by the valid-token count of the *whole* batch (counted before the scan, as the sums
    count: `mask` 1 and a target other than `IGNORE_INDEX`), so the result equals `jax.value_and_grad(loss_fn)` on
    the whole batch even when micro-batches hold different numbers of valid tokens (a per-micro-batch mean would
    weight their tokens unequally). Gradients are accumulated in the parameters' dtype and sharding (FSDP:
    reduce-scattered per micro-batch).
    Returns `(loss [], grads like params)`."""
    loss, grads, _ = loss_grads_by_source(params, batch, graphdef, rt, n)
    return loss, grads


def loss_grads_by_source(params: dict, batch: dict, graphdef, rt: model_lib.Runtime, n: int, sources: int = 0):
    """`accumulated_loss_and_grads`, and with `sources` > 0 (a data mixture: `batch['source']` int32 `[batch, seq]`,
    the source index + 1 of every token, 0 on padding) each source's loss sum over the targets the loss counted,
    float32 `[sources]` in nats (None without). Divided by `source_counts` it is each source's mean loss, so a chat
    source's assistant-token loss reads apart from a text source's loss.

    The per-token losses come for free from the gradient with respect to the mask: the loss is `sum(token_loss *
    mask) / total` with `total` counted before (not differentiated), so `d loss / d mask = token_loss / total` at
    every position (the tiled loss's backward computes it as well), summed where the loss counts the target.

    Returns `(loss [], grads like params, sums [sources] or None)`."""
    if n == 1 and not sources:
        return (*jax.value_and_grad(loss_fn)(params, batch, graphdef, rt), None)
    # the count the sums use: IGNORE_INDEX (-100) targets are left out even where `mask` is 1 (Hugging Face labels)
    total = jnp.maximum(jnp.sum(loss_lib.effective_mask(batch["targets"], batch["mask"])), 1.0)

    def scaled(p, mask, mb):
        return loss_sum_fn(p, {**mb, "mask": mask}, graphdef, rt)[0] / total

    def by_source(d_mask, mb):  # sum of each source's counted token losses: d_mask * total is the token loss
        counted = loss_lib.effective_mask(mb["targets"], mb["mask"])  # (d_mask is the loss at every position)
        onehot = (mb["source"][..., None] == jnp.arange(1, sources + 1)).astype(jnp.float32)
        return jnp.einsum("bs,bsk->k", d_mask.astype(jnp.float32) * total * counted, onehot)

    if n == 1:
        loss, (grads, d_mask) = jax.value_and_grad(scaled, argnums=(0, 1))(params, batch["mask"], batch)
        return loss, grads, by_source(d_mask, batch)

    def body(carry, mb):
        loss, grads, sums = carry
        if sources:
            l, (g, d_mask) = jax.value_and_grad(scaled, argnums=(0, 1))(params, mb["mask"], mb)
            sums = sums + by_source(d_mask, mb)
        else:
            l, g = jax.value_and_grad(scaled)(params, mb["mask"], mb)
        return (loss + l, jax.tree.map(jnp.add, grads, g), sums), None

    zeros = jax.tree.map(jnp.zeros_like, params)
    init = (jnp.zeros((), jnp.float32), zeros, jnp.zeros((max(sources, 1),), jnp.float32))
    (loss, grads, sums), _ = jax.lax.scan(body, init, micro_batches(batch, n, rt.mesh))
    return loss, grads, sums if sources else None


def source_counts(batch: dict, sources: int) -> jax.Array:
    """Targets the loss counted per source of a mixture's batch, float32 `[sources]` (see `loss_grads_by_source`)."""
    counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
    onehot = (batch["source"][..., None] == jnp.arange(1, sources + 1)).astype(jnp.float32)
    return jnp.einsum("bs,bsk->k", counted, onehot)


def init_state(cfg: Config, mesh: jax.sharding.Mesh, params: dict | None = None) -> dict:
    """Fresh optimizer state and `params` (default: freshly initialized), created directly in their shardings.
    `params` given (e.g. pretrained weights from `jaxlong.models.hf.load_params`) must already be in the
    FSDP shardings of `jaxlong.core.mesh.tree_shardings`."""
    params = model_lib.init_params(cfg, mesh) if params is None else params
    tx, _ = make_optimizer(cfg)
    opt_shardings = tree_shardings(mesh, jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return {"step": step, "params": params, "opt_state": opt_state}


def reset_optimizer(cfg: Config, mesh: jax.sharding.Mesh, state: dict) -> dict:
    """`state` with a fresh optimizer state for its parameters (`optim.reset_state`, at a recipe stage's first
    step): AdamW's moments zero and its bias-correction count 0, as at initialization, while the learning-rate
    schedule's count stays the global step `state['step']` (a stage's schedule starts at `optim.schedule_start`).
    Created in the optimizer state's shardings (`abstract_state`); the old state is not donated."""
    tx, _ = make_optimizer(cfg)
    shardings = jax.tree.map(lambda x: x.sharding, abstract_state(cfg, mesh)["opt_state"])
    scheduled = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731

    def fresh(params, step):
        return jax.tree.map(lambda x: x._replace(count=step.astype(x.count.dtype)) if scheduled(x) else x,
                            tx.init(params), is_leaf=scheduled)

    opt_state = jax.jit(fresh, out_shardings=shardings)(state["params"], state["step"])
    return {**state, "opt_state": opt_state}


def abstract_state(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """`ShapeDtypeStruct`s (with shardings) of the train state; nothing is allocated."""
    params = model_lib.abstract_params(cfg)
    tx, _ = make_optimizer(cfg)
    state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": jax.eval_shape(tx.init, params)}
    shardings = state_shardings(mesh, state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def state_shardings(mesh: jax.sharding.Mesh, state: dict) -> dict:
    return {
        "step": replicated(mesh),
        "params": tree_shardings(mesh, state["params"]),
        "opt_state": tree_shardings(mesh, state["opt_state"]),
    }


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh, batch_size: int | None = None) -> dict:
    """`ShapeDtypeStruct`s of one global batch (`batch_size` sequences, default `global_batch`), sharded batch
    over data x fsdp and sequence over ring x context (`batch_sharding`): `inputs`, `targets` int32, `mask` float32, `positions` int32
    (within each document) and `segment_ids` int32 (0 = padding), each `[batch_size, seq_len]`; with
    `objective: dpo` also `reference` float32 (`jaxlong.training.preference`)."""
    sh = batch_sharding(mesh)
    shape = (batch_size or cfg.global_batch, cfg.seq_len)
    out = {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
        "positions": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
    }
    if cfg.objective == "dpo":  # each pair half's reference log-probs at its first position
        out[preference.REFERENCE_KEY] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)
    return out


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
    rows = set()
    for device, idx in index.items():
        if process_of(device) == process:
            rows.update(range(global_batch)[idx[0]])
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
    zigzag order (`jaxlong.parallel.ring.zigzag_order`, arXiv 2310.01889 with the zigzag load balance of
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


def make_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """`train_step(state, batch) -> (state, metrics)`, jitted with explicit shardings and the state donated.

    metrics: `loss` (nats/token), `grad_norm` (global L2 norm before clipping), `lr`, `tokens_trained` (the
    targets the loss counted: not padding, not masked, e.g. a chat source's assistant tokens only); with
    `data.sources` also `source_loss` and `source_tokens_trained`, float32 `[sources]` (each source's mean loss and
    counted targets; the batch then carries `source`, `compile_train_step`). With `objective: dpo` the loss is the
    preference loss over the batch's pairs and the metrics add TRL's (`rewards/chosen`, `rewards/rejected`,
    `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`; `jaxlong.training.preference`); the
    batch then carries `reference`. With `grad_accum=N` the
    batch runs as N micro-batches of `global_batch / N` sequences (`accumulated_loss_and_grads`).
    """
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)
    tx, schedule = make_optimizer(cfg)

    sources = len(cfg.data.sources)

    def train_step(state, batch):
        if cfg.objective == "dpo":  # preference pairs: the loss and TRL's metrics (jaxlong.training.preference)
            micro = micro_batches(batch, cfg.grad_accum, mesh) if cfg.grad_accum > 1 else None
            loss, grads, extra = preference.loss_and_grads(state["params"], batch, graphdef, rt, micro)
            sums = None
        else:
            loss, grads, sums = loss_grads_by_source(state["params"], batch, graphdef, rt, cfg.grad_accum, sources)
            extra = {}
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        trained = jnp.sum(loss_lib.effective_mask(batch["targets"], batch["mask"]))  # targets the loss counted
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
                   "tokens_trained": trained, **extra}
        if sources:  # each source's mean loss over its counted targets (NaN where the batch holds none)
            counts = source_counts(batch, sources)
            metrics["source_loss"] = jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), jnp.nan)
            metrics["source_tokens_trained"] = counts
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    abstract = abstract_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_sharding(mesh)),  # every `[batch, seq]` entry alike, whatever the keys
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """Ahead-of-time compile of the train step for this config; nothing is allocated.

    With `data.sources` the batch also carries `source` (int32 `[batch, seq]`, each token's source index + 1).
    Returns the `jax.stages.Compiled`; its `memory_analysis()` gives per-device bytes.
    """
    batch = abstract_batch(cfg, mesh)
    if cfg.data.sources:  # a mixture's batch: the source of every token, for each source's loss
        batch["source"] = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32, sharding=batch_sharding(mesh))
    return make_train_step(cfg, mesh).lower(abstract_state(cfg, mesh), batch).compile()

"""The train state and the jitted train step: the objective's loss and gradients over the accumulated batch
(`jaxlong.training.accumulate`), then AdamW (`jaxlong.optim.adamw`).

The state is a plain dict `{'step': int32 [], 'params': {...}, 'opt_state': optax state}`; parameters,
gradients and optimizer moments share the FSDP sharding of `jaxlong.core.mesh.tree_shardings`. Every step takes
its batch in the input layout of `jaxlong.core.batch.put_batch`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxlong.config import Config, objective_of, runtime
from jaxlong.core.batch import batch_sharding
from jaxlong.core.mesh import replicated, tree_shardings
from jaxlong.data.mixture import SOURCE_FEATURE
from jaxlong.layers import loss as loss_lib
from jaxlong.models import llama as model_lib
from jaxlong.objectives.base import Objective
from jaxlong.optim.adamw import make_optimizer
from jaxlong.training.accumulate import loss_and_grads
from jaxlong.training.batches import BATCH_KEYS

__all__ = ["init_state", "reset_optimizer", "abstract_state", "abstract_params", "state_shardings", "abstract_batch",
           "make_train_step", "compile_train_step"]


def abstract_params(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """`ShapeDtypeStruct`s of the parameters in their FSDP shardings (`param_dtype`); nothing is allocated. What a
    checkpoint's weights are restored into (`jaxlong.training.checkpoint.restore_params`) and what the eval and
    generation steps take."""
    params = model_lib.abstract_params(cfg.model, cfg.param_dtype)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                        tree_shardings(mesh, params))


def init_state(cfg: Config, mesh: jax.sharding.Mesh, params: dict | None = None) -> dict:
    """Fresh optimizer state and `params` (default: freshly initialized), created directly in their shardings.
    `params` given (e.g. pretrained weights from `jaxlong.models.hf.load_params`) must already be in the
    FSDP shardings of `jaxlong.core.mesh.tree_shardings`."""
    params = model_lib.init_params(cfg.model, mesh, cfg.seed, cfg.param_dtype) if params is None else params
    tx, _ = make_optimizer(cfg.optim, cfg.steps)
    opt_shardings = tree_shardings(mesh, jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return {"step": step, "params": params, "opt_state": opt_state}


def reset_optimizer(cfg: Config, mesh: jax.sharding.Mesh, state: dict) -> dict:
    """`state` with a fresh optimizer state for its parameters (`optim.reset_state`, at a recipe stage's first
    step): AdamW's moments zero and its bias-correction count 0, as at initialization, while the learning-rate
    schedule's count stays the global step `state['step']` (a stage's schedule starts at `optim.schedule_start`).
    Created in the optimizer state's shardings (`abstract_state`); the old state is not donated."""
    tx, _ = make_optimizer(cfg.optim, cfg.steps)
    shardings = jax.tree.map(lambda x: x.sharding, abstract_state(cfg, mesh)["opt_state"])
    scheduled = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731

    def fresh(params, step):
        return jax.tree.map(lambda x: x._replace(count=step.astype(x.count.dtype)) if scheduled(x) else x,
                            tx.init(params), is_leaf=scheduled)

    opt_state = jax.jit(fresh, out_shardings=shardings)(state["params"], state["step"])
    return {**state, "opt_state": opt_state}


def abstract_state(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """`ShapeDtypeStruct`s (with shardings) of the train state; nothing is allocated."""
    params = model_lib.abstract_params(cfg.model, cfg.param_dtype)
    tx, _ = make_optimizer(cfg.optim, cfg.steps)
    state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params, "opt_state": jax.eval_shape(tx.init, params)}
    shardings = state_shardings(mesh, state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def state_shardings(mesh: jax.sharding.Mesh, state: dict) -> dict:
    return {
        "step": replicated(mesh),
        "params": tree_shardings(mesh, state["params"]),
        "opt_state": tree_shardings(mesh, state["opt_state"]),
    }


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh, batch_size: int | None = None,
                   objective: Objective | None = None) -> dict:
    """`ShapeDtypeStruct`s of one global batch (`batch_size` sequences, default `global_batch`), sharded batch
    over data x fsdp and sequence over ring x context (`batch_sharding`): `inputs`, `targets` int32, `mask`
    float32, `positions` int32 (within each document) and `segment_ids` int32 (0 = padding), each `[batch_size,
    seq_len]`, and the objective's own entries (`Objective.batch_keys`; default the run's objective, e.g. DPO's
    `reference` float32)."""
    shape = (batch_size or cfg.global_batch, cfg.seq_len)
    keys = {**BATCH_KEYS, **(objective or objective_of(cfg)).batch_keys}
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh)) for k, dtype in keys.items()}


def make_train_step(cfg: Config, mesh: jax.sharding.Mesh, objective: Objective | None = None):
    """`train_step(state, batch) -> (state, metrics)`, jitted with explicit shardings and the state donated.

    The loss is `objective`'s (default the run's, `objective`), accumulated over `grad_accum` micro-batches of
    `global_batch / grad_accum` sequences (`jaxlong.training.accumulate.loss_and_grads`). metrics: `loss`,
    `grad_norm` (global L2 norm before clipping), `lr`, `tokens_trained` (the targets the batch counts: not
    padding, not masked, e.g. a chat source's assistant tokens only), then the objective's own: with `data.sources`
    `source_loss` and `source_tokens_trained`, float32 `[sources]` (each source's mean loss and counted targets; the
    batch then carries `source`, `compile_train_step`); with `objective: dpo` TRL's (`rewards/chosen`,
    `rewards/rejected`, `rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`).
    """
    objective = objective or objective_of(cfg)
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    tx, schedule = make_optimizer(cfg.optim, cfg.steps)

    def train_step(state, batch):
        loss, grads, extra = loss_and_grads(objective, state["params"], batch, cfg.grad_accum, graphdef, rt)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        trained = jnp.sum(loss_lib.effective_mask(batch["targets"], batch["mask"]))  # targets the loss counted
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
                   "tokens_trained": trained, **extra}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    shardings = jax.tree.map(lambda x: x.sharding, abstract_state(cfg, mesh))
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_sharding(mesh)),  # every `[batch, seq]` entry alike, whatever the keys
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh, objective: Objective | None = None):
    """Ahead-of-time compile of the train step for this config (and `objective`); nothing is allocated.

    With `data.sources` the batch also carries `source` (int32 `[batch, seq]`, each token's source index + 1).
    Returns the `jax.stages.Compiled`; its `memory_analysis()` gives per-device bytes.
    """
    objective = objective or objective_of(cfg)
    batch = abstract_batch(cfg, mesh, objective=objective)
    if cfg.data.sources:  # a mixture's batch: the source of every token, for each source's loss
        batch[SOURCE_FEATURE] = jax.ShapeDtypeStruct(batch["inputs"].shape, jnp.int32, sharding=batch_sharding(mesh))
    return make_train_step(cfg, mesh, objective).lower(abstract_state(cfg, mesh), batch).compile()

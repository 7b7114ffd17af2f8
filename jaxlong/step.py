"""The train state, the optimizer, and the jitted train step (loss, gradients, AdamW update).

The state is a plain dict `{'step': int32 [], 'params': {...}, 'opt_state': optax state}`; parameters,
gradients and optimizer moments share the FSDP sharding of `jaxlong.mesh.tree_shardings`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding

from jaxlong import loss as loss_lib
from jaxlong import model as model_lib
from jaxlong.config import Config
from jaxlong.mesh import CONTEXT_AXIS, batch_spec, replicated, tree_shardings
from jaxlong.tiled import default_loss_tile, tiled_cross_entropy


def make_optimizer(cfg: Config) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax AdamW behind global-norm clipping, with linear warmup then cosine decay to `lr * min_lr_ratio`."""
    o = cfg.optim
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=max(o.decay_steps or cfg.steps, o.warmup_steps + 1),
        end_value=o.lr * o.min_lr_ratio,
    )
    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm) if o.clip_norm is not None else optax.identity(),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )
    return tx, schedule


def loss_fn(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> jax.Array:
    """Mean next-token cross-entropy of `batch` (`inputs`, `targets`, `mask`, each `[batch, seq]`); over
    sequence tiles when `tiling.loss`."""
    hidden, head = model_lib.forward(graphdef, params, batch["inputs"], rt)
    tiling = rt.cfg.tiling
    if tiling.loss:
        b, s = batch["targets"].shape
        s_local = s // rt.mesh.shape[CONTEXT_AXIS]
        b_local = max(b // (rt.mesh.shape["data"] * rt.mesh.shape["fsdp"]), 1)
        tile = tiling.loss_tile or default_loss_tile(s_local, head.shape[-1], batch=b_local)
        return tiled_cross_entropy(hidden, head, batch["targets"], batch["mask"], tile=tile, mesh=rt.mesh)
    return loss_lib.cross_entropy(hidden, head, batch["targets"], batch["mask"])


def init_state(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """Fresh parameters and optimizer state, created directly in their shardings."""
    params = model_lib.init_params(cfg, mesh)
    tx, _ = make_optimizer(cfg)
    opt_shardings = tree_shardings(mesh, jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated(mesh))
    return {"step": step, "params": params, "opt_state": opt_state}


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


def abstract_batch(cfg: Config, mesh: jax.sharding.Mesh) -> dict:
    """`ShapeDtypeStruct`s of one global batch, sharded batch over data x fsdp and sequence over context."""
    sh = NamedSharding(mesh, batch_spec())
    shape = (cfg.global_batch, cfg.seq_len)
    return {
        "inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh),
        "mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
    }


def make_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """`train_step(state, batch) -> (state, metrics)`, jitted with explicit shardings and the state donated.

    metrics: `loss` (nats/token), `grad_norm` (global L2 norm before clipping), `lr`.
    """
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)
    tx, schedule = make_optimizer(cfg)

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], batch, graphdef, rt)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"])}
        return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

    abstract = abstract_state(cfg, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, abstract)
    batch_sh = jax.tree.map(lambda x: x.sharding, abstract_batch(cfg, mesh))
    return jax.jit(
        train_step,
        in_shardings=(shardings, batch_sh),
        out_shardings=(shardings, replicated(mesh)),
        donate_argnums=0,
    )


def compile_train_step(cfg: Config, mesh: jax.sharding.Mesh):
    """Ahead-of-time compile of the train step for this config; nothing is allocated.

    Returns the `jax.stages.Compiled`; its `memory_analysis()` gives per-device bytes.
    """
    return make_train_step(cfg, mesh).lower(abstract_state(cfg, mesh), abstract_batch(cfg, mesh)).compile()

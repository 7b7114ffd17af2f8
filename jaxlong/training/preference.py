"""Preference optimization on packed pairs: DPO (sigmoid), IPO and SimPO, under every context-parallel mode.

The losses, per pair of a chosen response `c` and a rejected one `r` after the same prompt, with `pi` the policy's
and `ref` the frozen reference's summed response log-probabilities (nats), `beta = dpo.beta`:

* `sigmoid` (DPO, Rafailov et al., arXiv 2305.18290, eq. 7): `-log sigmoid(beta * ((pi_c - pi_r) - (ref_c - ref_r)))`;
* `ipo` (Azar et al., arXiv 2310.12036, eq. 17): `((pi_c - pi_r) - (ref_c - ref_r) - 1 / (2 beta))^2` on
  log-probabilities averaged over each response's tokens, as TRL's `DPOTrainer` does;
* `simpo` (Meng et al., arXiv 2405.14734, eq. 6): `-log sigmoid(beta * (pi_c - pi_r) - dpo.simpo_gamma)` on
  averaged log-probabilities, without a reference (TRL's `CPOTrainer` with `loss_type="simpo"`).

The loss is the mean over the pairs of the global batch. The metrics are TRL's: `rewards/chosen` and
`rewards/rejected` (`beta * (pi - ref)`; SimPO: `beta * pi`), `rewards/accuracies` (share of pairs whose chosen reward
is higher), `rewards/margins`, `logps/chosen`, `logps/rejected` (the policy's, averaged per token under ipo and simpo).

Layout (`jaxlong.data.preference`): the k-th pair of a row is its segments `2k - 1` (chosen) and `2k` (rejected);
`mask` marks the response tokens; `reference` holds each half's reference sum at the half's first position. The
per-token log-probabilities come from the train step's forward (dense, or `tiled_token_losses` under
`tiling.loss`), sharded by sequence over ring x context; each device sums its tokens per segment and the partial
sums are reduced over the sequence axes (`segment_sums`), so a pair reads the same whichever devices hold its
tokens. With `grad_accum` the sums are divided by the pairs of the whole global batch, counted before the
micro-batch scan: accumulation is exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlong.core.mesh import BATCH_AXES, seq_axes, seq_shards
from jaxlong.layers import loss as loss_lib
from jaxlong.layers.tiled import default_loss_tile, tiled_token_losses
from jaxlong.models import llama as model_lib

REFERENCE_KEY = "reference"  # the batch entry of the reference's sums (`jaxlong.data.pipeline.REFERENCE_FEATURE`)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


def token_logps(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> jax.Array:
    """Each target's log-probability under the model, float32 `[batch, seq]` (nats; any value where the target
    is `IGNORE_INDEX` or padding: mask it), by the train step's forward with document masking
    (`jaxlong.training.step.loss_sum_fn`'s), over sequence tiles when `tiling.loss`."""
    hidden, head = model_lib.forward(graphdef, params, batch["inputs"], rt, batch["positions"], batch["segment_ids"])
    if not rt.cfg.tiling.loss:
        return -loss_lib.token_losses(hidden, head, batch["targets"])
    b, s = batch["targets"].shape
    b_local = max(b // (rt.mesh.shape["data"] * rt.mesh.shape["fsdp"]), 1)
    tile = rt.cfg.tiling.loss_tile or default_loss_tile(s // seq_shards(rt.mesh), head.shape[-1], batch=b_local)
    return -tiled_token_losses(hidden, head, batch["targets"], tile=tile, mesh=rt.mesh)


def segment_sums(values: jax.Array, segment_ids: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """Sums of `values` per segment of each row: float32 `[batch, seq]`, entry `[b, k]` the sum over the positions
    of row b whose segment id is `k + 1` (segment 0, padding, is left out; a row has at most `seq` segments).

    Args:
      values: float `[batch, seq]`, laid out as the step's batch (batch over data x fsdp, sequence over ring x
        context, `jaxlong.training.step.put_batch`; any token order, zigzag included).
      segment_ids: int32 `[batch, seq]`, 0 = padding.
      mesh: the run's mesh.

    Each device sums its own tokens (`jax.ops.segment_sum`) and the partial sums are `psum`med over the sequence
    axes inside `jax.shard_map`; differentiable in `values`."""
    seq = values.shape[1]
    axes = seq_axes(mesh)

    def local(v, ids):
        sums = jax.vmap(lambda v_, i_: jax.ops.segment_sum(v_, i_, num_segments=seq + 1))(v.astype(jnp.float32), ids)
        return jax.lax.psum(sums[:, 1:], axes) if axes else sums[:, 1:]

    tok = P(BATCH_AXES, axes)
    return jax.shard_map(local, mesh=mesh, in_specs=(tok, tok), out_specs=P(BATCH_AXES, None),
                         check_vma=True)(values, segment_ids)


def _halves(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[batch, seq]` segment sums -> the chosen and rejected halves' `[batch, seq // 2]` (segments 2k - 1, 2k)."""
    pairs = sums[:, : 2 * (sums.shape[1] // 2)].reshape(sums.shape[0], -1, 2)
    return pairs[..., 0], pairs[..., 1]


def pair_count(batch: dict, mesh: jax.sharding.Mesh) -> jax.Array:
    """Pairs in a batch with response tokens in both halves (the loss's denominator), float32 scalar."""
    counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
    n_c, n_r = _halves(segment_sums(counted, batch["segment_ids"], mesh))
    return jnp.sum(((n_c > 0) & (n_r > 0)).astype(jnp.float32))


def preference_terms(logps: jax.Array, batch: dict, dpo, mesh: jax.sharding.Mesh) -> dict:
    """Per pair `[batch, seq // 2]` (a row's k-th pair at k - 1): `loss`, `chosen_rewards`, `rejected_rewards`,
    `chosen_logps`, `rejected_logps` (float32) and `valid` (1.0 where the pair exists), from per-token `logps`
    (`token_logps`) and the batch's `mask`, `segment_ids` and `reference`; `dpo`: the `dpo` config section
    (`loss`, `beta`, `simpo_gamma`)."""
    counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
    seg = batch["segment_ids"]
    pi_c, pi_r = _halves(segment_sums(jnp.where(counted > 0, logps, 0.0), seg, mesh))
    n_c, n_r = _halves(segment_sums(counted, seg, mesh))
    valid = ((n_c > 0) & (n_r > 0)).astype(jnp.float32)
    if dpo.loss == "simpo":
        ref_c = ref_r = jnp.zeros_like(pi_c)
    else:
        ref_c, ref_r = _halves(segment_sums(batch[REFERENCE_KEY], seg, mesh))
    if dpo.loss in ("ipo", "simpo"):  # log-probs averaged over each response's tokens
        pi_c, pi_r = pi_c / jnp.maximum(n_c, 1.0), pi_r / jnp.maximum(n_r, 1.0)
        ref_c, ref_r = ref_c / jnp.maximum(n_c, 1.0), ref_r / jnp.maximum(n_r, 1.0)
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    if dpo.loss == "sigmoid":
        loss = -jax.nn.log_sigmoid(dpo.beta * logits)
    elif dpo.loss == "ipo":
        loss = (logits - 1.0 / (2.0 * dpo.beta)) ** 2
    else:
        loss = -jax.nn.log_sigmoid(dpo.beta * logits - dpo.simpo_gamma)
    return {"loss": loss * valid, "chosen_rewards": dpo.beta * (pi_c - ref_c) * valid,
            "rejected_rewards": dpo.beta * (pi_r - ref_r) * valid, "chosen_logps": pi_c * valid,
            "rejected_logps": pi_r * valid, "valid": valid}


def metric_sums(t: dict) -> dict:
    """The loss and TRL's metrics (`METRICS`) summed over the pairs of `preference_terms`' result: divided by the
    pair count they are the batch's means."""
    chosen, rejected = t["chosen_rewards"], t["rejected_rewards"]
    return {"loss": jnp.sum(t["loss"]), "rewards/chosen": jnp.sum(chosen), "rewards/rejected": jnp.sum(rejected),
            "rewards/accuracies": jnp.sum((chosen > rejected) * t["valid"]),
            "rewards/margins": jnp.sum(chosen - rejected), "logps/chosen": jnp.sum(t["chosen_logps"]),
            "logps/rejected": jnp.sum(t["rejected_logps"])}


def preference_sums(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> dict:
    """`metric_sums` of one batch under `params`: the loss sum over its pairs (differentiable) and the metrics'."""
    return metric_sums(preference_terms(token_logps(params, batch, graphdef, rt), batch, rt.cfg.dpo, rt.mesh))


def loss_and_grads(params: dict, batch: dict, graphdef, rt: model_lib.Runtime, micro: dict | None = None):
    """The preference loss (mean over the global batch's pairs), its gradient and TRL's metrics, over the whole
    `batch`, or with `micro` (the batch as micro-batches `[n, rows / n, seq]`, `jaxlong.training.step.micro_batches`:
    rows stay whole, so pairs do) in a `lax.scan`, one micro-batch's activations live at a time.

    Returns `(loss [], grads like params, metrics {name: []})`."""
    total = jnp.maximum(pair_count(batch, rt.mesh), 1.0)

    def scaled(p, mb):
        sums = preference_sums(p, mb, graphdef, rt)
        return sums.pop("loss") / total, sums

    def body(carry, mb):
        loss, grads, sums = carry
        (l, s), g = jax.value_and_grad(scaled, has_aux=True)(params, mb)
        return (loss + l, jax.tree.map(jnp.add, grads, g), jax.tree.map(jnp.add, sums, s)), None

    if micro is None:
        (loss, sums), grads = jax.value_and_grad(scaled, has_aux=True)(params, batch)
    else:
        init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params),
                {k: jnp.zeros((), jnp.float32) for k in METRICS})
        (loss, grads, sums), _ = jax.lax.scan(body, init, micro)
    return loss, grads, {k: v / total for k, v in sums.items()}

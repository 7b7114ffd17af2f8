"""What a training objective owns, and the model calls every objective shares.

An objective (`Objective`) turns a batch into a loss and its metrics, the way Levanter's trainer takes a `loss_fn`:
the trainer (`jaxlong.training`) accumulates it over micro-batches (`jaxlong.training.accumulate`), evaluation
runs the same sums on held-out batches (`jaxlong.evaluation.steps`), and neither knows which objective it runs.
It owns:

* its batch spec: the `[batch, seq]` entries its batches carry beyond the language model's (`batch_keys`);
* its loss *sums* (`sums`: the loss summed over its units, tokens or pairs, differentiable, and metric sums) and
  what they are divided by (`denominator`), normalised over the whole accumulated batch (`normalize = "batch"`,
  TRL's `dapo`) or per micro-batch (`"micro"`, as TRL's `bnpo`, `grpo` and `dr_grpo` do), so that sums from
  micro-batches, devices and validation batches combine exactly;
* its metrics (`metrics`: the train step's; `summary`: a validation's);
* its preparation (`prepare`: what runs once before the first step with what the trainer passes in, e.g. DPO's
  reference pass).

A new objective is one module of `jaxlong.objectives` and one entry in its registry (`jaxlong.objectives.registry`);
a user's own can also be passed to the trainer directly (docs/training.md#the-trainer-as-a-library).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlong.core.mesh import BATCH_AXES, seq_axes, seq_shards
from jaxlong.layers import loss as loss_lib
from jaxlong.layers.tiled import loss_tile, tiled_loss_sum, tiled_token_entropies, tiled_token_losses
from jaxlong.models import llama as model_lib

__all__ = ["Objective", "Preparation", "forward", "token_losses", "token_logps_and_entropies", "loss_sum",
           "segment_sums"]


# ----------------------------------------------------------------------------------------------
# The model on a batch: the forward and the loss's tiles, shared by every objective.


def forward(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> tuple[jax.Array, jax.Array]:
    """`(hidden [b, s, hidden], head [hidden, vocab])` of a batch in the steps' input layout
    (`jaxlong.core.batch.put_batch`): `inputs`, with `positions` (RoPE) and `segment_ids` (document masking, used
    when `rt.document_masking`) where present, each `[b, s]`."""
    segment_ids = batch.get("segment_ids") if rt.document_masking else None
    return model_lib.forward(graphdef, params, batch["inputs"], rt, batch.get("positions"), segment_ids)


def _tile(hidden: jax.Array, head: jax.Array, rt: model_lib.Runtime) -> int:
    b, s = hidden.shape[:2]
    b_local = max(b // math.prod(rt.mesh.shape[a] for a in BATCH_AXES), 1)
    return loss_tile(rt.tiling, s // seq_shards(rt.mesh), head.shape[-1], b_local)


def token_losses(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> jax.Array:
    """Each target's cross-entropy, float32 `[b, s]` (nats; any value where the target is `IGNORE_INDEX` or
    padding: mask it), over sequence tiles under `tiling.loss` (`[b, s, vocab]` logits never exist then)."""
    hidden, head = forward(params, batch, graphdef, rt)
    return _head_losses(hidden, head, batch["targets"], rt)


def _head_losses(hidden: jax.Array, head: jax.Array, targets: jax.Array, rt: model_lib.Runtime) -> jax.Array:
    if not rt.tiling.loss:
        return loss_lib.token_losses(hidden, head, targets)
    return tiled_token_losses(hidden, head, targets, tile=_tile(hidden, head, rt), mesh=rt.mesh)


def token_logps_and_entropies(params: dict, batch: dict, graphdef, rt: model_lib.Runtime,
                              temperature: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Each target's log-probability under `softmax(logits / temperature)` (differentiable) and each position's
    entropy of that distribution (no gradient), float32 `[b, s]` each in nats, from one forward; over sequence
    tiles under `tiling.loss` (`[b, s, vocab]` logits never exist then). The logits divided by the sampling
    temperature are what GRPO scores (TRL's `GRPOTrainer`). Values where the target is `IGNORE_INDEX` or padding
    are meaningless: mask them."""
    hidden, head = forward(params, batch, graphdef, rt)
    if temperature != 1.0:  # (h / T) @ W = logits / T: the head is linear
        hidden = hidden / jnp.asarray(temperature, hidden.dtype)
    logps = -_head_losses(hidden, head, batch["targets"], rt)
    if not rt.tiling.loss:
        return logps, loss_lib.token_entropies(hidden, head)
    return logps, tiled_token_entropies(hidden, head, tile=_tile(hidden, head, rt), mesh=rt.mesh)


def loss_sum(params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> jax.Array:
    """The next-token cross-entropy summed over the targets the batch counts (`mask`, `IGNORE_INDEX` left out),
    float32 nats; over sequence tiles under `tiling.loss`."""
    hidden, head = forward(params, batch, graphdef, rt)
    if rt.tiling.loss:
        return tiled_loss_sum(hidden, head, batch["targets"], batch["mask"], tile=_tile(hidden, head, rt),
                              mesh=rt.mesh)[0]
    mask = loss_lib.effective_mask(batch["targets"], batch["mask"])
    return jnp.sum(loss_lib.token_losses(hidden, head, batch["targets"]) * mask)


def segment_sums(values: jax.Array, segment_ids: jax.Array, mesh: jax.sharding.Mesh) -> jax.Array:
    """Sums of `values` per segment of each row: float32 `[batch, seq]`, entry `[b, k]` the sum over the positions
    of row b whose segment id is `k + 1` (segment 0, padding, is left out; a row has at most `seq` segments).

    Args:
      values: float `[batch, seq]`, laid out as the step's batch (batch over data x fsdp, sequence over ring x
        context, `jaxlong.core.batch.put_batch`; any token order, zigzag included).
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


# ----------------------------------------------------------------------------------------------
# The interface.


@dataclasses.dataclass
class Preparation:
    """What an objective's `prepare` may use, passed in by the command that runs it (the trainer, the evaluation).

    Attributes:
      cfg: the run's config, read-only (its data, seq_len, batch and stage; the objective's own section).
      run_dir: the run directory (where an objective keeps what it computes once, e.g. `RUN_DIR/reference/`).
      source: the training data source (`jaxlong.data.first_source`).
      tokenizer: the run's tokenizer.
      graphdef, rt: the model's graph and runtime on the run's mesh (`jaxlong.config.runtime`).
      start_params: returns the weights the run starts from; None where they are gone (resumed inside the stage).
      load_params: `load_params(hf_directory) -> params` in the run's FSDP shardings (a reference model).
      say: prints a line on process 0.
    """

    cfg: Any
    run_dir: Path
    source: Any
    tokenizer: Any
    graphdef: Any
    rt: model_lib.Runtime
    start_params: Callable[[], dict] | None
    load_params: Callable[[str], dict]
    say: Callable[[str], None] = print


class Objective:
    """A training objective: loss sums, their denominator, metrics and preparation (module docstring).

    Attributes (class-level defaults; subclasses set their own):
      name: the value of the config's `objective` that selects it.
      batch_keys: `{key: numpy dtype}`, the `[batch, seq]` entries its batches carry beyond `inputs`, `targets`,
        `mask`, `positions` and `segment_ids`.
      normalize: `"batch"`: the accumulated loss is `sum of sums / denominator of the whole batch`; `"micro"`: each
        micro-batch's `sums / its denominator`, averaged over the micro-batches.
      prepares_batches: its training and validation batches hold what `prepare` computes (DPO's reference
        log-probs): they are made after it runs.
      summary_key: where a validation's results sit: None at the top (`eval/loss`), else under this key
        (`eval/<key>/loss`, `summary[<key>]`).
      unit: what the denominator counts (`tokens`, `pairs`): the count's key in a validation's results.
      records: what its held-out data are made of (`documents`, `pairs`), for messages.
      title: its name in messages (`DPO`).
      gate_metrics: the held-out metrics a recipe's gate may hold it to, under `summary_key` (`dpo/loss`, ...).
      held_out_loss: a validation computes its own loss on its held-out data (False: it has none, e.g. GRPO, whose
        data are rollouts; a validation then scores held-out documents by the language-modelling loss).
      reference_on_device: a frozen copy of the parameters stays on the devices beside the train step (GRPO's KL
        reference), which the memory planner counts.
    """

    name: str = ""
    batch_keys: dict[str, Any] = {}
    normalize: str = "batch"
    prepares_batches: bool = False
    summary_key: str | None = None
    unit: str = "tokens"
    records: str = "documents"
    title: str = "language modelling"
    gate_metrics: tuple[str, ...] = ()
    held_out_loss: bool = True
    reference_on_device: bool = False

    @classmethod
    def from_config(cls, cfg) -> Objective:
        """The objective of a run's config (its sections)."""
        return cls()

    def check(self, data) -> None:
        """The objective's rules on the data section (`data.*`), run by `jaxlong.config.validate`.

        Raises:
          ConfigError: naming the option, its value and what would work.
        """

    def check_run(self, cfg) -> None:
        """The objective's rules on the rest of the run's config (its own section, the model, seq_len), run by
        `jaxlong.config.validate` after `check`.

        Raises:
          ConfigError: naming the option, its value and what would work.
        """

    def check_files(self, model) -> None:
        """What the objective reads from disk, checked against the model section before anything compiles.

        Raises:
          ConfigError: naming the option and what is wrong with its file.
        """

    def denominator(self, batch: dict, mesh: jax.sharding.Mesh) -> jax.Array:
        """What the loss sums are divided by, counted on `batch` (float32 []; not differentiated)."""
        raise NotImplementedError

    def sum_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shapes of `sums`' metric sums (the accumulator's zeros)."""
        return {}

    def sums(self, params: dict, batch: dict, graphdef, rt: model_lib.Runtime) -> tuple[jax.Array, dict]:
        """`(loss_sum [], {metric: sum})` of `batch` under `params`: the loss differentiable in `params`."""
        raise NotImplementedError

    def metrics(self, sums: dict, denominator: jax.Array, batch: dict) -> dict:
        """The train step's metrics beyond `loss` from the accumulated metric sums and denominator."""
        return {}

    def host_denominator(self, batch: dict) -> float | None:
        """The denominator counted on the host (float64, exact at any length) where it can be, else None."""
        return None

    def summary(self, loss_sum: float, sums: dict, denominator: float) -> dict:
        """A validation's results from the totals over its batches: `loss` and the objective's own."""
        raise NotImplementedError

    def describe(self, ev: dict) -> str:
        """One line of a validation's results (after `eval loss ...`)."""
        return f"{ev['loss']:.4f}"

    def report(self, ev: dict) -> str:
        """A line of `python -m jaxlong.eval`'s printed summary for the objective's own held-out results (those
        under `summary_key`)."""
        return f"{self.title} loss {ev['loss']:.4f}"

    def prepare(self, run: Preparation) -> None:
        """What runs once before the first step (and before an evaluation): nothing by default."""

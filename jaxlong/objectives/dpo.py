"""Preference optimization on packed pairs (`objective: dpo`): DPO (sigmoid), IPO and SimPO, under every
context-parallel mode.

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

Layout (`jaxlong.data.preference`): the k-th pair of a row is its segments `2k - 1` (chosen) and `2k` (rejected),
or, with `data.shared_prompt`, its document k's branches 1 and 2 after the prompt (`half_ids`);
`mask` marks the response tokens; `reference` holds each half's reference sum at the half's first position. The
per-token log-probabilities come from the train step's forward (dense, or `tiled_token_losses` under
`tiling.loss`), sharded by sequence over ring x context; each device sums its tokens per segment and the partial
sums are reduced over the sequence axes (`segment_sums`), so a pair reads the same whichever devices hold its
tokens. With `grad_accum` the sums are divided by the pairs of the whole global batch, counted before the
micro-batch scan: accumulation is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.core.errors import ConfigError
from jaxlong.layers import loss as loss_lib
from jaxlong.objectives.base import Objective, Preparation, segment_sums, token_losses
from jaxlong.objectives.reference import check_reference, half_ids, prepare_reference

PreferenceLoss = Literal["sigmoid", "ipo", "simpo"]  # `dpo.loss`
REFERENCE_KEY = "reference"  # the batch entry of the reference's sums (`jaxlong.data.pipeline.REFERENCE_FEATURE`)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class DPOConfig:
    """The `dpo` section: preference optimization (`objective: dpo`, docs/post-training.md) on `data.format:
    preference` pairs."""

    loss: PreferenceLoss = "sigmoid"  # sigmoid (DPO), ipo, or simpo (no reference)
    beta: float = 0.1  # the KL penalty's strength (DPO's beta); under simpo the reward scale
    simpo_gamma: float = 0.5  # SimPO's target margin (nats, on per-token averaged log-probs)
    # The frozen reference whose log-probs are computed once, before the first DPO step, and kept in
    # RUN_DIR/reference/: "policy" (the weights the run or the recipe's stage starts from), or a Hugging Face
    # model directory of the same architecture.
    reference: str = "policy"


def _halves(sums: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`[batch, seq]` segment sums -> the chosen and rejected halves' `[batch, seq // 2]` (segments 2k - 1, 2k)."""
    pairs = sums[:, : 2 * (sums.shape[1] // 2)].reshape(sums.shape[0], -1, 2)
    return pairs[..., 0], pairs[..., 1]


def pair_count(batch: dict, mesh: jax.sharding.Mesh) -> jax.Array:
    """Pairs in a batch with response tokens in both halves (the loss's denominator), float32 scalar."""
    counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
    n_c, n_r = _halves(segment_sums(counted, half_ids(batch["segment_ids"]), mesh))
    return jnp.sum(((n_c > 0) & (n_r > 0)).astype(jnp.float32))


def preference_terms(logps: jax.Array, batch: dict, dpo, mesh: jax.sharding.Mesh) -> dict:
    """Per pair `[batch, seq // 2]` (a row's k-th pair at k - 1): `loss`, `chosen_rewards`, `rejected_rewards`,
    `chosen_logps`, `rejected_logps` (float32) and `valid` (1.0 where the pair exists), from per-token `logps`
    (`jaxlong.objectives.base.token_losses`, negated) and the batch's `mask`, `segment_ids` and `reference`; `dpo`: the `dpo` config section (`DPOConfig`)
    (`loss`, `beta`, `simpo_gamma`)."""
    counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
    seg = half_ids(batch["segment_ids"])
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


class PreferenceOptimization(Objective):
    """DPO, IPO or SimPO on packed pairs (`objective: dpo`, the `dpo` section): the mean loss over the pairs of the
    accumulated batch and TRL's metrics (module docstring); the reference's log-probs, where the loss has one, are
    computed once by `prepare` (`jaxlong.objectives.reference`) and carried by the batches (`reference`)."""

    name = "dpo"
    batch_keys = {REFERENCE_KEY: np.float32}
    prepares_batches = True
    summary_key = "dpo"
    unit = "pairs"
    records = "pairs"
    title = "DPO"
    gate_metrics = ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "rewards/rejected")

    def __init__(self, dpo: DPOConfig):
        self.dpo = dpo

    @classmethod
    def from_config(cls, cfg) -> PreferenceOptimization:
        return cls(cfg.dpo)

    @property
    def needs_reference(self) -> bool:
        """Whether the loss uses a reference (`dpo.loss` sigmoid or ipo; simpo has none)."""
        return self.dpo.loss != "simpo"

    def check(self, data) -> None:
        """Preference pairs and only them (`data.format: preference`, no mixture), a positive `dpo.beta` and a
        reference.

        Raises:
          ConfigError: naming the option, its value and what would work.
        """
        if data.sources or data.format != "preference":
            raise ConfigError("objective=dpo trains on preference pairs: set data.format=preference with data.path a "
                              ".jsonl of prompt/chosen/rejected records" + (", without data.sources" if data.sources
                                                                              else f" (data.format is {data.format!r})"),
                              key="objective", value=self.name)
        if not self.dpo.beta > 0:
            raise ConfigError(f"dpo.beta={self.dpo.beta} must be positive (TRL's default is 0.1)", key="dpo.beta",
                              value=self.dpo.beta)
        if not str(self.dpo.reference).strip():
            raise ConfigError("dpo.reference is empty; give policy (the weights the run starts from) or a Hugging Face "
                              "model directory")

    def check_files(self, model) -> None:
        """`dpo.reference`, when a Hugging Face directory, against the model (`check_reference`)."""
        if self.needs_reference:
            check_reference(self.dpo.reference, model)

    def denominator(self, batch: dict, mesh) -> jax.Array:
        return pair_count(batch, mesh)

    def sum_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: () for k in METRICS}

    def sums(self, params: dict, batch: dict, graphdef, rt) -> tuple[jax.Array, dict]:
        logps = -token_losses(params, batch, graphdef, rt)
        sums = metric_sums(preference_terms(logps, batch, self.dpo, rt.mesh))
        return sums.pop("loss"), sums

    def metrics(self, sums: dict, denominator: jax.Array, batch: dict) -> dict:
        return {k: v / denominator for k, v in sums.items()}

    def summary(self, loss_sum: float, sums: dict, denominator: float) -> dict:
        n = max(denominator, 1.0)
        return {"loss": loss_sum / n, **{k: v / n for k, v in sums.items()}, "pairs": denominator}

    def describe(self, ev: dict) -> str:
        return (f"{ev['loss']:.4f} (reward accuracy {ev['rewards/accuracies']:.3f}, margin "
                f"{ev['rewards/margins']:.3f}, {ev['pairs']:.0f} held-out pairs)")

    def report(self, ev: dict) -> str:
        return (f"held-out pairs ({ev['pairs']:.0f}): DPO loss {ev['loss']:.4f}, rewards/accuracies "
                f"{ev['rewards/accuracies']:.3f}, rewards/margins {ev['rewards/margins']:.4f} (chosen "
                f"{ev['rewards/chosen']:.4f}, rejected {ev['rewards/rejected']:.4f})")

    def prepare(self, run: Preparation) -> None:
        """The reference log-probs of every pair (`jaxlong.objectives.reference.prepare_reference`), read from or
        written to `RUN_DIR/reference/`, where the loss has a reference."""
        if self.needs_reference:
            prepare_reference(run, self.dpo.reference)

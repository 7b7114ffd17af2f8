"""GRPO, group relative policy optimization (Shao et al., arXiv 2402.03300 section 4.1), as TRL's `GRPOTrainer`
computes it (trl v1.9.0: `_generate_and_score_completions` for the advantages, with its default
`multi_objective_aggregation="sum_then_normalize"`, and `_compute_loss` for the loss), under TRL's option names,
on shared-prefix rows under every context-parallel mode.

**Rows.** A group is one prompt and its G = `num_generations` completions, packed as the prompt once and G
branches (`jaxlong.data.groups`, `jaxlong.core.segments`), so the prompt's tokens are computed once. Besides the
language model's entries a batch carries, per token, `completion` (the completion's number in its row, 1-based; 0
on prompts and padding), `advantages` (its completion's advantage), and optionally `old_logps` (the log-probs at
the rollout's parameters, for `num_iterations` > 1) and `ref_logps` (the reference's, for `beta` > 0). `mask` marks
the completion tokens the loss counts (`mask_truncated_completions` zeroes a completion that did not end).

**Advantages** (`group_advantages`, on the host): the rewards of a group minus their mean, divided by the group's
standard deviation + 1e-4 (`scale_rewards="group"`), the batch's (`"batch"`) or not at all (`"none"`); standard
deviations are unbiased. The rewards are each reward function's score times `reward_weights`, summed with a
missing score (None) left out (`combine_rewards`); a completion no function could score has no reward: it is left
out of its group's mean and deviation, and its advantage is 0.

**Loss**, per completion token t with `logp` the policy's log-probability of the logits divided by `temperature`:
`ratio = exp(logp - old_logp)` (`old_logp` = `stop_gradient(logp)` without `old_logps`, so the ratio is 1),
`loss_t = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * kl_t` with TRL's k3 estimator
`kl_t = exp(ref - logp) - (ref - logp) - 1`. Summed and normalised by `loss_type`:

* `grpo`: each completion's mean over its tokens, averaged over the micro-batch's completions;
* `bnpo`: the micro-batch's token sum over its counted tokens;
* `dr_grpo`: the micro-batch's token sum over completions x `max_completion_length`;
* `dapo` (TRL's default): the token sum over the counted tokens of the whole accumulated batch.

The first three are normalised per micro-batch and averaged over the micro-batches (`normalize = "micro"`), as
TRL divides each micro-batch's loss by the accumulation steps; `dapo` over the accumulated batch (`"batch"`).
Per-completion sums over a sequence sharded by ring and context are `segment_sums` (one `psum`). Log-probs and
entropies come from one forward, over sequence tiles under `tiling.loss` (`[seq, vocab]` logits never exist).

**Metrics** (TRL's names): `entropy`, `kl` (with `beta` > 0), `clip_ratio/low_mean` (ratio below `1 - epsilon`
with a negative advantage), `clip_ratio/high_mean` (above `1 + epsilon_high` with a positive one) and
`clip_ratio/region_mean` (either), each a mean over the accumulated batch's counted tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.layers.loss import effective_mask
from jaxlong.objectives.base import Objective, segment_sums, token_logps_and_entropies

__all__ = ["GRPOConfig", "check_groups_fit", "RULER_LENGTH", "GroupRelativePolicyOptimization",
           "group_advantages", "combine_rewards", "LossType", "ScaleRewards", "COMPLETION", "ADVANTAGES", "OLD_LOGPS",
           "REF_LOGPS"]

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]  # `grpo.loss_type`
ScaleRewards = Literal["group", "batch", "none"]  # `grpo.scale_rewards`
COMPLETION, ADVANTAGES, OLD_LOGPS, REF_LOGPS = "completion", "advantages", "old_logps", "ref_logps"
RULER_LENGTH = 512  # grpo.ruler_lengths' default
METRICS = ("entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass
class GRPOConfig:
    """The `grpo` section (`objective: grpo`, docs/post-training.md#grpo): GRPO's options under TRL's `GRPOConfig`
    names (module docstring), and where the prompts and rewards come from."""

    num_generations: int = 8  # G, completions per prompt
    max_completion_length: int = 256  # tokens a completion may take, its EOS included (dr_grpo's constant)
    temperature: float = 1.0  # sampling temperature; log-probs are of the logits divided by it
    top_p: float = 1.0  # sampling's nucleus (1.0: off)
    top_k: int = 0  # sampling's top-k (0: off)
    beta: float = 0.0  # the KL term's weight (0: no reference)
    epsilon: float = 0.2  # the ratio's lower clip, 1 - epsilon
    epsilon_high: float | None = None  # the upper clip, 1 + epsilon_high (None: epsilon; DAPO uses 0.28)
    loss_type: LossType = "dapo"
    scale_rewards: ScaleRewards = "group"
    mask_truncated_completions: bool = False  # a completion that did not end (no EOS) counts no token
    num_iterations: int = 1  # mu, optimizer steps per batch of rollouts
    reward_funcs: list[str] = field(default_factory=lambda: ["string_match_all"])  # shipped names or module:function
    reward_weights: list[float] | None = None  # one per reward function (None: 1 each)
    # The prompts: "ruler" (RULER cases of `ruler_task` at `ruler_lengths`, made by jaxlong, refs as a column), or
    # a JSONL file in TRL's prompt-only format (`prompt`: text or a list of messages; other columns go to rewards).
    dataset: str = "ruler"
    ruler_task: str = "niah_single_1"
    ruler_lengths: list[int] = field(default_factory=list)  # RULER's length (prompt + its generation budget); []: 512
    ruler_cases: int = 0  # RULER prompts per length (0: as many as the stage's rollouts draw, 16 to 256)
    prompts_per_step: int = 0  # groups per optimizer step (0: global_batch, one group per row)
    chat: bool = False  # render prompts with the run's chat template (messages always are)
    # The frozen reference of the KL term (beta > 0): "policy" (the weights the run or stage starts from, kept as
    # a second FSDP-sharded copy on the devices and saved once in RUN_DIR/grpo_reference/), or a Hugging Face
    # directory of the same architecture.
    reference: str = "policy"
    log_completions: bool = True  # a few completions per logged step as TensorBoard text
    num_completions_to_print: int = 4

    def check(self) -> None:
        """The section's own rules.

        Raises:
          ConfigError: naming the option, its value and what would work.
        """
        check_choice("grpo.loss_type", self.loss_type, LossType)
        check_choice("grpo.scale_rewards", self.scale_rewards, ScaleRewards)
        if self.num_generations < 2:
            raise ConfigError(f"grpo.num_generations={self.num_generations}: group-relative advantages need at least "
                              f"2 completions per prompt (a group of 1 has advantage 0 and trains nothing)",
                              key="grpo.num_generations", value=self.num_generations)
        for key in ("max_completion_length", "num_iterations", "num_completions_to_print"):
            if getattr(self, key) < 1:
                raise ConfigError(f"grpo.{key}={getattr(self, key)} must be >= 1", key=f"grpo.{key}")
        if self.prompts_per_step < 0 or self.top_k < 0 or self.ruler_cases < 0:
            raise ConfigError(f"grpo.prompts_per_step={self.prompts_per_step}, grpo.top_k={self.top_k}, "
                              f"grpo.ruler_cases={self.ruler_cases}: give counts >= 0 (0: global_batch prompts; no "
                              f"top-k; as many RULER cases as the rollouts draw)")
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"grpo.temperature={self.temperature}, grpo.top_p={self.top_p}: the temperature must be "
                              f"> 0 and top_p in (0, 1]")
        if not self.epsilon > 0 or (self.epsilon_high is not None and not self.epsilon_high > 0) or self.beta < 0:
            raise ConfigError(f"grpo.epsilon={self.epsilon}, grpo.epsilon_high={self.epsilon_high}, grpo.beta="
                              f"{self.beta}: the clips must be > 0 (TRL: 0.2; DAPO's upper 0.28) and beta >= 0")
        if not self.reward_funcs:
            raise ConfigError("grpo.reward_funcs=[]: name at least one reward (string_match_all, string_match_part, "
                              "think_format, or module:function)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"grpo.reward_weights={self.reward_weights} has {len(self.reward_weights)} weights for "
                              f"{len(self.reward_funcs)} grpo.reward_funcs; give one per function, or none")
        if any(n <= 0 for n in self.ruler_lengths):
            raise ConfigError(f"grpo.ruler_lengths={self.ruler_lengths}: give positive token counts, e.g. [1024]")

    def group_tokens(self, prompt_tokens: int) -> int:
        """Positions a group of a `prompt_tokens`-token prompt takes at most in a row (`jaxlong.data.groups`):
        the prompt once, then G branches of its last token and a whole completion."""
        return prompt_tokens - 1 + self.num_generations * (1 + self.max_completion_length)


def check_groups_fit(cfg, prompt_tokens: int) -> None:
    """Refuse rows that cannot hold `grpo.prompts_per_step` groups of a `prompt_tokens`-token prompt: a group longer
    than `seq_len`, or more groups than `global_batch` rows of `seq_len` hold.

    Raises:
      ConfigError: naming the options and what would fit.
    """
    g = cfg.grpo
    need = g.group_tokens(prompt_tokens)
    if need > cfg.seq_len:
        raise ConfigError(f"objective=grpo: a group of a {prompt_tokens}-token prompt and grpo.num_generations="
                          f"{g.num_generations} completions of up to grpo.max_completion_length="
                          f"{g.max_completion_length} tokens takes {need} positions, more than seq_len={cfg.seq_len}; "
                          f"raise seq_len to {need}, or lower those", key="seq_len", value=cfg.seq_len,
                          suggestions=({"seq_len": need},))
    prompts = g.prompts_per_step or cfg.global_batch
    fit = cfg.global_batch * (cfg.seq_len // need)
    if prompts > fit:
        raise ConfigError(f"objective=grpo: grpo.prompts_per_step={prompts} groups of up to {need} positions do not "
                          f"fit global_batch={cfg.global_batch} rows of seq_len={cfg.seq_len} (at most {fit}); lower "
                          f"grpo.prompts_per_step or raise global_batch", key="grpo.prompts_per_step", value=prompts,
                          suggestions=({"grpo.prompts_per_step": fit},))


def combine_rewards(per_function: np.ndarray, weights: Sequence[float] | None = None) -> np.ndarray:
    """Each completion's reward, float64 `[n]`: the reward functions' scores `[n, functions]` (NaN where a function
    returned None) times `weights` (None: 1 each), summed with the NaNs left out (TRL's `nansum`); NaN where every
    function returned None (an unscorable completion).

    Raises:
      ValueError: `weights` not one per function."""
    scores = np.asarray(per_function, np.float64)
    w = np.ones(scores.shape[1]) if weights is None else np.asarray(weights, np.float64)
    if w.shape != (scores.shape[1],):
        raise ValueError(f"grpo.reward_weights has {w.size} weights for {scores.shape[1]} reward functions")
    rewards = np.nansum(scores * w, axis=1)
    return np.where(np.isnan(scores).all(axis=1), np.nan, rewards)


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """TRL's `nanstd`: the unbiased standard deviation over the values that are not NaN (NaN for fewer than 2)."""
    n = np.sum(~np.isnan(x), axis=axis)
    mean = np.nanmean(x, axis=axis, keepdims=True) if np.any(n) else np.full_like(x, np.nan)
    var = np.nansum((x - mean) ** 2, axis=axis) / np.where(n > 1, n - 1, np.nan)
    return np.sqrt(var)


def group_advantages(rewards: np.ndarray, num_generations: int, scale_rewards: str = "group"
                     ) -> tuple[np.ndarray, np.ndarray]:
    """TRL's advantages: `(advantages, std)`, float64 `[n]` each, for `rewards` `[n]` (NaN: unscorable) in groups of
    `num_generations` consecutive completions: the reward minus its group's mean, divided by the group's unbiased
    standard deviation + 1e-4 (`group`), the batch's (`batch`) or nothing (`none`), NaNs left out and an unscorable
    completion's advantage 0; `std` is the one it would divide by (the group's for `none`, as TRL logs).

    Raises:
      ValueError: `n` not a multiple of `num_generations`."""
    r = np.asarray(rewards, np.float64)
    if r.size % num_generations:
        raise ValueError(f"{r.size} rewards are not whole groups of grpo.num_generations={num_generations}")
    grouped = r.reshape(-1, num_generations)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.repeat(np.array([np.nanmean(g) if np.any(~np.isnan(g)) else np.nan for g in grouped]),
                         num_generations)
        if scale_rewards == "batch":
            std = np.full(r.shape, _nanstd(r) if r.size > 1 else 0.0)
        else:
            std = np.repeat(_nanstd(grouped, axis=1), num_generations)
        advantages = r - mean
        if scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    return np.nan_to_num(advantages, nan=0.0), std


class GroupRelativePolicyOptimization(Objective):
    """GRPO's loss and TRL's metrics on shared-prefix rows (module docstring); `cfg` the `grpo` section."""

    name = "grpo"
    records = "groups"
    title = "GRPO"
    held_out_loss = False  # no held-out rollouts: a GRPO run validates on held-out documents' text loss, and RULER

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.normalize = "batch" if cfg.loss_type == "dapo" else "micro"
        self.reference_on_device = bool(cfg.beta)  # the KL reference: a second FSDP-sharded copy of the weights
        # old log-probs only where the ratio can leave 1 (mu > 1); the reference's only with the KL term
        self.batch_keys = {COMPLETION: np.int32, ADVANTAGES: np.float32,
                           **({OLD_LOGPS: np.float32} if cfg.num_iterations > 1 else {}),
                           **({REF_LOGPS: np.float32} if cfg.beta else {})}

    @classmethod
    def from_config(cls, cfg) -> GroupRelativePolicyOptimization:
        return cls(cfg.grpo)

    def check_run(self, cfg) -> None:
        """What `objective: grpo` needs of the rest of the run: segment ids (`data.packing=documents`, the
        shared-prefix rows' masks), no sliding window (a branch's window counts positions, not row indices), and rows
        of `seq_len` that hold a group of the longest RULER prompt.

        Raises:
          ConfigError: naming the option, its value and what would work.
        """
        g = cfg.grpo
        g.check()
        if cfg.data.packing != "documents":
            raise ConfigError(f"objective=grpo: data.packing={cfg.data.packing!r}; GRPO's rows hold each prompt once "
                              f"and its completions as branches, masked by segment ids", key="data.packing",
                              value=cfg.data.packing, suggestions=({"data.packing": "documents"},))
        if cfg.model.sliding_window:
            raise ConfigError(f"objective=grpo: model.sliding_window={cfg.model.sliding_window} counts positions, and "
                              f"a group's second branch does not follow the prompt in the row; GRPO takes "
                              f"full-attention models", key="objective", value="grpo", keys=("model.sliding_window",))
        # a file's prompts are measured when read (`jaxlong.rl.prompts`); here the least prompt, or RULER's longest
        check_groups_fit(cfg, max(g.ruler_lengths or [RULER_LENGTH]) if g.dataset == "ruler" else 1)

    def sum_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: () for k in (*METRICS, "tokens")}

    def _completions(self, batch: dict, mesh) -> jax.Array:
        """Completions in the batch (float32 []): the distinct `completion` numbers of each row."""
        ids = batch[COMPLETION]
        return jnp.sum(segment_sums((ids > 0).astype(jnp.float32), ids, mesh) > 0).astype(jnp.float32)

    def denominator(self, batch: dict, mesh) -> jax.Array:
        if self.cfg.loss_type == "grpo":
            return self._completions(batch, mesh)
        if self.cfg.loss_type == "dr_grpo":
            return self._completions(batch, mesh) * self.cfg.max_completion_length
        return jnp.sum(effective_mask(batch["targets"], batch["mask"]))

    def sums(self, params: dict, batch: dict, graphdef, rt) -> tuple[jax.Array, dict]:
        g = self.cfg
        logps, entropy = token_logps_and_entropies(params, batch, graphdef, rt, g.temperature)
        m = effective_mask(batch["targets"], batch["mask"])
        logps = jnp.where(m > 0, logps, 0.0)
        old = jnp.where(m > 0, batch[OLD_LOGPS], 0.0) if OLD_LOGPS in batch else jax.lax.stop_gradient(logps)
        adv = batch[ADVANTAGES].astype(jnp.float32)
        high = g.epsilon if g.epsilon_high is None else g.epsilon_high
        ratio = jnp.exp(logps - old)
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1.0 - g.epsilon, 1.0 + high) * adv)
        kl = jnp.zeros_like(logps)
        if g.beta:
            d = jnp.where(m > 0, batch[REF_LOGPS], 0.0) - logps
            kl = jnp.exp(d) - d - 1.0
            per_token = per_token + g.beta * kl
        counted = per_token * m
        if g.loss_type == "grpo":  # each completion's mean over its tokens
            ids = batch[COMPLETION]
            n = segment_sums(m, ids, rt.mesh)
            loss = jnp.sum(segment_sums(counted, ids, rt.mesh) / jnp.maximum(n, 1.0))
        else:
            loss = jnp.sum(counted)
        ratio = jax.lax.stop_gradient(ratio)
        low_clip = ((ratio < 1.0 - g.epsilon) & (adv < 0)).astype(jnp.float32)
        high_clip = ((ratio > 1.0 + high) & (adv > 0)).astype(jnp.float32)
        region = jnp.maximum(low_clip, high_clip)
        sums = {"entropy": entropy, "kl": jax.lax.stop_gradient(kl), "clip_ratio/low_mean": low_clip,
                "clip_ratio/high_mean": high_clip, "clip_ratio/region_mean": region}
        sums = {k: jnp.sum(v * m) for k, v in sums.items()}
        return loss, {**sums, "tokens": jnp.sum(m)}

    def metrics(self, sums: dict, denominator: jax.Array, batch: dict) -> dict:
        n = jnp.maximum(sums["tokens"], 1.0)
        keys = METRICS if self.cfg.beta else tuple(k for k in METRICS if k != "kl")
        return {k: sums[k] / n for k in keys}

    def summary(self, loss_sum: float, sums: dict, denominator: float) -> dict:
        n = max(sums.get("tokens", 0.0), 1.0)
        return {"loss": loss_sum / max(denominator, 1.0), **{k: sums[k] / n for k in METRICS if k in sums}}

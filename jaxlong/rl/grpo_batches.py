"""GRPO's training batches, drawn on the training mesh from the parameters each step starts from.

`GRPOBatches` is what the train command passes the trainer for `objective: grpo` (`jaxlong.recipes.train`): an
on-policy batch source (`jaxlong.training.batches.PolicyBatchFn`) and a hook (`jaxlong.training.hooks.Hook`).
The trainer imports neither generation nor rewards; this module, a floor above both, joins them. Every
`grpo.num_iterations` steps (TRL's mu) it:

1. takes `grpo.prompts_per_step` prompts (`jaxlong.rl.prompts`, an epoch's permutation seeded by the run's seed);
2. samples G = `grpo.num_generations` completions of each from its one prompt cache
   (`jaxlong.generation.generate.Generator`, `Sampling.n`), reading the current parameters (no copy of the
   policy), up to `grpo.max_completion_length` tokens or an EOS;
3. scores them with `grpo.reward_funcs` (`jaxlong.rl.rewards`), weighs and sums them, and computes TRL's group
   advantages (`jaxlong.objectives.grpo.group_advantages`);
4. packs the groups as shared-prefix rows (`jaxlong.rl.rollouts.pack_groups`); with mu > 1 adds `old_logps`, the
   training forward's log-probs at the rollout's parameters (so the first iteration's ratio is exactly 1, as in
   TRL); with `grpo.beta` > 0 `ref_logps`, the reference's, whose weights are a second FSDP-sharded copy on the
   devices without optimizer state (`grpo.reference`; counted by `python -m jaxlong.memory`'s GRPO plan).

The steps between rollouts train on the same batch. A run resumed between two rollouts draws a fresh one at the
resumed parameters. The hook logs TRL's metrics (`reward`, `reward_std`, `frac_reward_zero_std`,
`rewards/NAME/mean`, `rewards/NAME/std`, `completions/mean_length`, `completions/min_length`,
`completions/max_length`, `completions/clipped_ratio`, `completions/mean_terminated_length`), the rollout's and
the step's time apart (`timing/rollout_s`, `timing/train_s`) and, with `grpo.log_completions`, a few completions
as TensorBoard text (`completions`).
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong import data as data_lib
from jaxlong.config import Config, runtime
from jaxlong.core.batch import natural_order, process_rows, put_batch
from jaxlong.core.errors import ConfigError
from jaxlong.data.chat import run_template
from jaxlong.data.tokenizer import stop_ids
from jaxlong.generation.decode import Sampling
from jaxlong.generation.generate import Generator
from jaxlong.models import hf
from jaxlong.models import llama as model_lib
from jaxlong.objectives import grpo as G
from jaxlong.objectives.base import token_logps_and_entropies
from jaxlong.objectives.registry import objective_for
from jaxlong.rl.prompts import PromptSet, load_prompts
from jaxlong.rl.rewards import NEEDS_COLUMNS, completion_text, load_reward, score_completions
from jaxlong.rl.rollouts import Group, pack_groups
from jaxlong.training.batches import BATCH_KEYS, PolicyBatchFn
from jaxlong.training.hooks import Hook, RunContext, StepContext
from jaxlong.training.step import abstract_params

__all__ = ["GRPOBatches", "rollout_metrics"]

REFERENCE_DIR = "grpo_reference"  # RUN_DIR/grpo_reference/stageN: the reference weights of grpo.reference=policy


def rollout_metrics(rewards: np.ndarray, per_function: np.ndarray, names: list[str], std: np.ndarray,
                    lengths: np.ndarray, ended: np.ndarray, num_generations: int) -> dict[str, float]:
    """TRL's rollout metrics (module docstring) of one batch: `rewards` `[n]` (NaN: unscorable), `per_function`
    `[n, functions]`, `std` the advantages' divisor per completion (`group_advantages`), `lengths` `[n]` tokens
    per completion (EOS included), `ended` `[n]` bool (an EOS, not cut at `max_completion_length`)."""
    group_std = std.reshape(-1, num_generations)[:, 0]
    out = {"reward": float(np.nanmean(rewards)) if np.any(~np.isnan(rewards)) else float("nan"),
           "reward_std": float(np.nanmean(group_std)) if np.any(~np.isnan(group_std)) else 0.0,
           "frac_reward_zero_std": float(np.mean(np.nan_to_num(group_std, nan=0.0) < 1e-6))}
    for j, name in enumerate(names):
        col = per_function[:, j]
        scored = col[~np.isnan(col)]
        out[f"rewards/{name}/mean"] = float(scored.mean()) if scored.size else float("nan")
        out[f"rewards/{name}/std"] = float(scored.std(ddof=1)) if scored.size > 1 else 0.0
    out.update({"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
                "completions/max_length": float(lengths.max()),
                "completions/clipped_ratio": float(1.0 - ended.mean()),
                "completions/mean_terminated_length": float(lengths[ended].mean()) if ended.any() else 0.0})
    return out


class GRPOBatches(PolicyBatchFn):
    """GRPO's on-policy batches and their hook (module docstring); `run(cfg, batches=b, hooks=[b.hook])`.

    Raises (at construction, before anything compiles): ValueError naming a reward that cannot be loaded. From
    the hook's start: ConfigError for a prompt set that cannot be made or does not fit (`jaxlong.rl.prompts`).
    """

    def __init__(self, cfg: Config):
        self.cfg, self.g = cfg, cfg.grpo
        self.funcs = [(getattr(f, "__name__", spec), f) for spec, f in ((s, load_reward(s))
                                                                          for s in self.g.reward_funcs)]
        self.hook = Hook(self._log, every=1, name="grpo", start=self._start)
        self.cached: tuple[int, dict] | None = None
        self.latest: dict = {}
        self.ref = None

    # ---- start: before the train step compiles

    def _start(self, run: RunContext) -> None:
        cfg, g = run.cfg, self.g
        self.run, self.mesh = run, run.mesh
        directory = data_lib.tokenizer_source(cfg, run.run_dir)
        chat = run_template(cfg.data.chat_template, directory, run_dir=run.run_dir)
        self.per_step = g.prompts_per_step or cfg.global_batch
        source = run.source if run.source is not None or g.dataset != "ruler" else data_lib.first_source(
            cfg, run.tokenizer)
        # RULER: as many cases per length as the stage's rollouts take (16 to 256; a longer stage repeats them)
        rollouts = -(-(cfg.steps - cfg.optim.schedule_start) // g.num_iterations)
        cases = g.ruler_cases or max(16, min(rollouts * self.per_step, 256))
        self.prompts: PromptSet = load_prompts(cfg, run.tokenizer, cases=cases, chat=chat, source=source)
        longest = max(t.size for t in self.prompts.tokens)
        G.check_groups_fit(cfg, longest)  # the rows hold prompts_per_step groups of the longest prompt
        for spec, (name, _) in zip(g.reward_funcs, self.funcs):  # a shipped reward's columns, before compiling
            missing = [c for c in NEEDS_COLUMNS.get(spec, ()) if c not in self.prompts.columns]
            if missing:
                raise ConfigError(f"grpo.reward_funcs: {name} reads the column {', '.join(missing)}, which "
                                  f"grpo.dataset={g.dataset} does not have; add it to every record, or choose "
                                  f"another reward", key="grpo.reward_funcs", value=g.reward_funcs)
        self.pad_to = longest
        self.gen = Generator(cfg, run.mesh, None, run.tokenizer, max_new_tokens=g.max_completion_length,
                             sampling=Sampling(g.temperature, g.top_k, g.top_p, n=g.num_generations),
                             eos_ids=stop_ids(run.tokenizer, directory))
        graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, run.mesh)
        self.logps = jax.jit(lambda p, b: token_logps_and_entropies(p, b, graphdef, rt, g.temperature)[0],
                             out_shardings=NamedSharding(run.mesh, P()))
        run.say(f"grpo: {len(self.prompts)} prompts ({g.dataset}), {self.per_step} per rollout x "
                f"{g.num_generations} completions of up to {g.max_completion_length} tokens, rewards "
                f"{', '.join(n for n, _ in self.funcs)}")

    # ---- the batches

    def __call__(self, step: int, rows: np.ndarray, params: dict) -> dict:
        rollout = (step - 1 - self.cfg.optim.schedule_start) // self.g.num_iterations
        if self.cached is None or self.cached[0] != rollout:
            self.cached = (rollout, self._rollout(rollout, step, params))
        else:  # mu > 1: the rollout's batch again, nothing sampled
            self.latest["timing/rollout_s"] = 0.0
        self.t_ready = time.perf_counter()
        return {k: v[rows] for k, v in self.cached[1].items()}

    def _indices(self, rollout: int) -> list[int]:
        """The prompts of rollout `rollout`: consecutive slices of a permutation per epoch (seeded)."""
        n, k = len(self.prompts), self.per_step
        spots = [divmod(j, n) for j in range(rollout * k, rollout * k + k)]  # (epoch, index in its permutation)
        orders = {e: np.random.default_rng([self.cfg.seed, e]).permutation(n) for e in {e for e, _ in spots}}
        return [int(orders[e][at]) for e, at in spots]

    def _rollout(self, rollout: int, step: int, params: dict) -> dict:
        cfg, g, gn = self.cfg, self.g, self.g.num_generations
        t0 = time.perf_counter()
        idx = self._indices(rollout)
        self.gen.params = params
        out = self.gen([self.prompts.tokens[i] for i in idx], seed=cfg.seed * 1_000_003 + rollout, pad_to=self.pad_to)
        ids = [o.tokens + ([o.eos_id] if o.reason == "eos" else []) for o in out]
        ended = np.array([o.reason == "eos" for o in out])
        ps = self.prompts
        prompts = [ps.prompts[i] for i in idx for _ in range(gn)]
        completions = [[{"role": "assistant", "content": o.text}] if ps.conversational else o.text for o in out]
        columns = {k: [v[i] for i in idx for _ in range(gn)] for k, v in ps.columns.items()}
        scores = score_completions(self.funcs, prompts, completions, ids, columns)
        rewards = G.combine_rewards(scores, g.reward_weights)
        if np.isnan(rewards).all():  # as TRL warns: nothing to learn from this rollout
            self.run.say(f"grpo: every reward returned None (or NaN) for all {len(rewards)} completions of rollout "
                         f"{rollout}: their advantages are 0 and this rollout trains nothing")
        adv, std = G.group_advantages(rewards, gn, g.scale_rewards)
        groups = [Group(ps.tokens[i], ids[k * gn:(k + 1) * gn], ended[k * gn:(k + 1) * gn], adv[k * gn:(k + 1) * gn])
                  for k, i in enumerate(idx)]
        batch, _ = pack_groups(groups, cfg.global_batch, cfg.seq_len, g.mask_truncated_completions)
        if g.num_iterations > 1:  # the old policy's log-probs: the training forward at the rollout's parameters
            batch[G.OLD_LOGPS] = self._logps(params, batch)
        if g.beta:
            batch[G.REF_LOGPS] = self._logps(self._reference(params, step), batch)
        lengths = np.array([len(t) for t in ids])
        self.latest = {**rollout_metrics(rewards, scores, [n for n, _ in self.funcs], std, lengths, ended, gn),
                       "timing/rollout_s": time.perf_counter() - t0}
        self.samples = [(ps.prompts[idx[r // gn]], out[r].text, rewards[r], adv[r])
                        for r in range(min(g.num_completions_to_print, len(out)))]
        return batch

    def _logps(self, params: dict, batch: dict) -> np.ndarray:
        """The training forward's log-probs of `batch` under `params` (float32 `[rows, seq]`), `global_batch /
        grad_accum` rows at a time (a micro-batch's activations; each row's log-probs are its own)."""
        cfg = self.cfg
        micro = cfg.global_batch // cfg.grad_accum
        parts = []
        for s in range(0, cfg.global_batch, micro):
            rows = process_rows(self.mesh, micro)
            host = {k: batch[k][s:s + micro][rows] for k in BATCH_KEYS}
            got = self.logps(params, put_batch(host, self.mesh, rows, micro))
            parts.append(natural_order(np.asarray(got.addressable_data(0)), self.mesh))
        return np.concatenate(parts).astype(np.float32)

    def _reference(self, params: dict, step: int) -> dict:
        """The KL term's reference weights, FSDP-sharded: `grpo.reference`'s Hugging Face weights, or the weights
        the run (or stage) starts from, saved once in RUN_DIR/grpo_reference/stageN/ so that a resumed run finds
        them.

        Raises:
          ValueError: resumed inside the stage with the saved reference gone."""
        if self.ref is not None:
            return self.ref
        cfg = self.cfg
        if self.g.reference != "policy":
            self.ref = hf.load_params(self.g.reference, cfg.model, self.mesh, cfg.param_dtype)
            return self.ref
        path = (Path(self.run.run_dir) / REFERENCE_DIR / f"stage{cfg.stage}").absolute()
        ckpt = ocp.StandardCheckpointer()
        if path.exists():
            self.ref = ckpt.restore(path, abstract_params(cfg, self.mesh))
        elif step - 1 == cfg.optim.schedule_start:  # the weights the stage starts from
            self.ref = jax.tree.map(lambda x: x.copy(), params)
            ckpt.save(path, self.ref)
            ckpt.wait_until_finished()
        else:
            raise ValueError(f"grpo.beta={self.g.beta}: the reference (the weights stage {cfg.stage} started from) "
                             f"is not in {path}; resume from the stage's start, or give grpo.reference=HF_DIR")
        return self.ref

    # ---- the hook: metrics, completions, timing

    def _log(self, ctx: StepContext) -> None:
        if not self.latest:
            return
        m = {**self.latest, "timing/train_s": time.perf_counter() - self.t_ready}
        if ctx.writer is not None:
            for k, v in m.items():
                ctx.writer.add_scalar(k, v, ctx.step)
            if self.g.log_completions and self.samples and self.cached[0] != getattr(self, "_shown", None):
                self._shown = self.cached[0]
                ctx.writer.add_text("completions", _table(self.samples), ctx.step)
        ctx.metrics.update(m)  # the run's result and later hooks see them
        if ctx.step % 10 == 0 or ctx.step == ctx.cfg.steps:
            ctx.say(f"step {ctx.step}: reward {m['reward']:.3f}, reward_std {m['reward_std']:.3f}, completions "
                    f"{m['completions/mean_length']:.1f} tokens; rollout {m['timing/rollout_s']:.1f} s, train "
                    f"{m['timing/train_s']:.1f} s")


def on_policy_batches(cfg: Config) -> GRPOBatches | None:
    """The batch source of an objective that trains on its own samples: GRPO's rollouts on the training mesh for
    `objective: grpo`, None for an objective that reads its data (the trainer's data pipeline)."""
    return GRPOBatches(cfg) if isinstance(objective_for(cfg), G.GroupRelativePolicyOptimization) else None


def _table(samples: list) -> str:
    """A Markdown table of (prompt, completion, reward, advantage), the prompt's last 200 characters."""
    def cell(x) -> str:
        return completion_text(x).replace("|", "\\|").replace("\n", " ")

    rows = [f"| ...{cell(p)[-200:]} | {cell(c)} | {r:.3f} | {a:.3f} |" for p, c, r, a in samples]
    return "\n".join(["| prompt | completion | reward | advantage |", "|---|---|---|---|", *rows])

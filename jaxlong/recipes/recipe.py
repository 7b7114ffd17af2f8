"""Context-extension recipes: several training stages in one config, run in order in one run directory.

A pretrained model's context is extended in stages, not in one jump: LWM (Liu et al., arXiv 2402.08268, section
3.1) grew Llama-2-7B from 32K to 1M tokens in five stages, raising RoPE's theta at each and starting each from
the previous one's weights; ProLong (Gao et al., arXiv 2410.02660, section 3) trains 64K then 512K on a
mixture of long and short data. A recipe is a config with `stages:`, a list of mappings:

    stages:
      - {name: 8k, steps: 200, seq_len: 8192, model: {rope_theta: 500000}}
      - {name: 32k, steps: 100, seq_len: 32768, model.rope_theta: 2000000, optim.warmup_steps: 10}

Each stage sets its own `steps` (the stage's length) and any config keys (nested or dotted): `seq_len`, RoPE
(`model.rope_theta`, `model.rope_scaling.*`), the data (`data.sources`, a mixture with its length rules), the
learning rate and schedule (`optim.*`: each stage warms up and decays over its own steps), the mesh, attention,
remat and tiling. `expand` turns the recipe into one ordinary, validated `Config` per stage before anything
compiles (every stage's errors at once): the base config, then the stage's keys, then the command line's
overrides, with `steps` = the stage's last global step, `optim.schedule_start` = its first, `stage` = its index.

`run_recipe` runs each stage as `train` runs one config (the trainer with the validation hooks): the first from the
base weights (or `model.from_hf`), each next one from the checkpoint the previous stage ended with, its parameters
and optimizer state, on its own mesh and compiled step, with its own data from the start (shuffled with another
seed: `jaxlong.data.pipeline.STAGE_SEED`). The global step runs on across stages; TensorBoard shows one run with
`seq_len` and `stage` as scalars. Checkpoints record their stage (the config saved with them), so `--resume` after a
kill anywhere continues the stage the latest checkpoint belongs to: mid-stage with its data state, at a boundary
with the next stage. A stage may end with a gate (`jaxlong.recipes.gates`): an evaluation of its last checkpoint
with thresholds, which stops the recipe (`GateFailed`) or warns when one is missed. Running a stage is exactly
`python -m jaxlong.train --resume-with-changes` with that stage's config: a recipe is the chain of runs a user would
otherwise type by hand.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from jaxlong import data as data_lib
from jaxlong.config import Config, ConfigError, apply_setting, changed_keys, parse_override, validate
from jaxlong.core.distributed import say as _say
from jaxlong.evaluation.validation import validation_hooks
from jaxlong.recipes import gates as gate_lib
from jaxlong.rl.grpo_batches import on_policy_batches
from jaxlong.training.checkpoint import Checkpointer
from jaxlong.training.loop import run

__all__ = ["Stage", "check_sources", "expand", "train", "run_recipe", "stage_of_step"]

STAGE_KEYS = ("name", "steps", "gate")  # a stage's own keys; every other key is a config key


@dataclasses.dataclass
class Stage:
    """One stage of a recipe: `index`, `name`, its global steps `(start, end]`, its validated `cfg` and its
    `gate` (`jaxlong.recipes.gates.Gate`, evaluated on the stage's last checkpoint; None: no gate)."""

    index: int
    name: str
    start: int
    end: int
    cfg: Config
    gate: gate_lib.Gate | None = None


def expand(cfg: Config, overrides=()) -> list[Stage]:
    """The stages of a recipe config (`cfg.stages`), each an ordinary validated `Config`.

    Args:
      cfg: the recipe as `jaxlong.config.load_config` read it (its `stages` not applied).
      overrides: the command line's `key=value` overrides, applied to every stage after the stage's own keys.

    Returns:
      `Stage` per stage, in order; stage i's `cfg` has `steps` = the sum of the stages' steps through i,
      `optim.schedule_start` = the sum before it, `stage` = i and no `stages`.

    Raises:
      ConfigError: one line naming every stage that is wrong (no `steps` or `steps` < 1, an unknown key, a wrong
        type, a combination `validate` refuses, e.g. a `seq_len` the stage's mesh cannot split), why, and what
        would pass: advice about the stage's own keys or the command line's first (`validate(changed=...)`). Its
        `errors` hold one `ConfigError` per stage, whose key and suggestions name the stage's keys as
        `stages[i].KEY`.
    """
    if not cfg.stages:
        raise ConfigError("the config has no stages: a recipe needs `stages:`, a list of mappings with `steps`")
    if cfg.stage or cfg.optim.schedule_start:
        raise ConfigError("stage and optim.schedule_start are set by a recipe's stages; leave them out of it")
    if cfg.steps != Config().steps or any(t.split("=", 1)[0].strip() == "steps" for t in overrides):
        raise ConfigError(f"steps={cfg.steps}: a recipe's stages set their own steps; drop the top-level or "
                          "command-line steps and give each stage its steps")
    stages, errors, start = [], [], 0
    settings = [parse_override(text) for text in overrides]
    for i, raw in enumerate(cfg.stages):
        name = str(raw.get("name") or f"stage{i}")
        at = f"stage {i} ({name})"
        steps = raw.get("steps")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            errors.append(ConfigError(f"{at}: steps={steps!r}; give the stage's number of steps (an integer >= 1)",
                                      key=f"stages[{i}].steps", value=steps))
            continue
        out = copy.deepcopy(cfg)
        out.stages = []
        try:
            for key, value in raw.items():
                if key in ("stage", "stages", "optim.schedule_start") or \
                        (key == "optim" and isinstance(value, dict) and "schedule_start" in value):
                    raise ConfigError(f"{key} is set by the recipe (the stage's index, its first step); leave it out")
                if key not in STAGE_KEYS:
                    apply_setting(out, key, value)
            for s in settings:
                apply_setting(out, *s)
            out.steps, out.optim.schedule_start, out.stage = start + steps, start, i
            own = {k: v for k, v in raw.items() if k not in STAGE_KEYS}
            validate(out, changed=changed_keys(settings, own))
            gate = gate_lib.parse_gate(raw["gate"], out) if raw.get("gate") is not None else None
        except ConfigError as e:
            errors.append(_in_stage(e, i, at))
        else:
            stages.append(Stage(i, name, start, start + steps, out, gate))
        start += steps
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigError("; ".join(map(str, errors)), errors=tuple(errors))
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise ConfigError(f"the stages' names repeat ({', '.join(names)}); give each a distinct name")
    return stages


def _in_stage(error: ConfigError, i: int, at: str) -> ConfigError:
    """`error` of stage `i` (`at`: "stage i (name)"), its message prefixed with `at` and its options named
    `stages[i].KEY`, as a stage sets them (a suggestion set in the stage overrides the base config's value)."""
    def staged(key: str) -> str:
        return f"stages[{i}].{key}"

    return ConfigError(f"{at}: {error}", key=staged(error.key) if error.key else None, value=error.value,
                       keys=tuple(map(staged, error.keys)),
                       suggestions=tuple({staged(k): v for k, v in s.items()} for s in error.suggestions))


def check_sources(stages: list[Stage]) -> None:
    """Open every stage's corpora (`data.path` or each of `data.sources`) and check its gate's passkey prompt
    against its tokenizer before the first stage starts, so that a missing or empty corpus of a later stage is
    found before hours of the earlier ones.

    Raises:
      ValueError: one line naming the stage and the source (`jaxlong.data.sources.DocumentSource`).
    """
    seen = set()
    for s in stages:
        d = s.cfg.data
        key = repr((d.path, d.text_field, [(x.path, x.text_field) for x in d.sources]))
        if key in seen:
            continue
        seen.add(key)
        try:
            (data_lib.mixture_sources if d.sources else data_lib.first_source)(s.cfg)
        except ValueError as e:
            raise ValueError(f"stage {s.index} ({s.name}): {e}") from None
    for s in stages:
        if s.gate is not None:
            try:
                gate_lib.check_prompt(s.gate, s.cfg)
            except ValueError as e:
                raise ValueError(f"stage {s.index} ({s.name}): {e}") from None


def stage_of_step(stages: list[Stage], step: int) -> int:
    """The index of the first stage not finished at global step `step` (a checkpoint's), `len(stages)` when all
    are."""
    return next((s.index for s in stages if step < s.end), len(stages))


def train(cfg: Config, *, hooks=(), batches=None, resume: bool = False, profile: bool = False,
          allow_changes: bool = False, objective=None) -> dict:
    """One training run as `python -m jaxlong.train` runs it: the trainer (`jaxlong.training.loop.run`, whose
    arguments these are) with the validation hooks first (the held-out loss and RULER every `eval_every` steps,
    `jaxlong.evaluation.validation.validation_hooks`), then `hooks`. With `objective: grpo` (and no `batches`)
    the batches are GRPO's rollouts on the training mesh, with their metrics' hook (`jaxlong.rl.grpo_batches`).

    Returns and raises: as `jaxlong.training.loop.run`.
    """
    own = []
    if batches is None and (batches := on_policy_batches(cfg)) is not None:
        own = [batches.hook]
    return run(cfg, objective=objective, hooks=[*own, *validation_hooks(cfg), *hooks], batches=batches,
               resume=resume, profile=profile, allow_changes=allow_changes)


def run_recipe(stages: list[Stage], *, resume: bool = False, profile: bool = False,
               evaluate: gate_lib.Evaluate = gate_lib.evaluate_gate, say=_say) -> dict:
    """Run `stages` in order in their run directory (`train` per stage, each after the first resuming the previous
    stage's last checkpoint with its changes), each stage's gate after it (`jaxlong.recipes.gates.run_gate`). With
    `resume`, start at the stage of the latest checkpoint (mid-stage: that stage goes on; at a boundary: the
    finished stage's gate is decided, from its record where it has one, then the next stage starts).

    `evaluate` runs a gate's evaluation (default `jaxlong.recipes.gates.evaluate_gate`: `python -m jaxlong.eval`'s
    evaluation in this process).

    Returns: the last stage's `run` result (`metrics`, `run_dir`).

    Raises: ValueError from `check_sources` before the first stage; what `run` raises (`Preempted` on SIGTERM/SIGINT,
      after saving the last finished step); `GateFailed` when a gate with `action: stop` misses a threshold (after
      the stage's checkpoint).
    """
    check_sources(stages)
    first = stages[0].cfg
    run_dir = Path(first.run_dir) / first.run_name
    latest = Checkpointer.latest_in(run_dir / "checkpoints") if resume else None
    begin = 0 if latest is None else stage_of_step(stages, latest)
    out = {"metrics": {}, "run_dir": str(run_dir)}
    if begin and latest == stages[begin - 1].end:  # resumed at a boundary: the finished stage's gate first
        _gate(stages, begin - 1, run_dir, evaluate, say)
    if begin == len(stages):
        say(f"nothing to do: the latest checkpoint is step {latest}, the end of the recipe's last stage "
            f"({stages[-1].name})")
        return out
    for s in stages[begin:]:
        say(f"recipe: stage {s.index} ({s.name}), steps {s.start + 1}-{s.end}, seq_len {s.cfg.seq_len}")
        out = train(s.cfg, resume=resume or s.index > 0, profile=profile, allow_changes=True)
        resume = True
        _gate(stages, s.index, run_dir, evaluate, say)
    return out


def _gate(stages: list[Stage], i: int, run_dir: Path, evaluate, say) -> None:
    s = stages[i]
    if s.gate is not None:
        nxt = stages[i + 1].name if i + 1 < len(stages) else None
        gate_lib.run_gate(s.gate, s.index, s.name, s.end, run_dir, next_name=nxt, evaluate=evaluate, say=say)

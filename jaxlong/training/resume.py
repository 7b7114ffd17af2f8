"""Resuming a run: what a checkpoint's config and shapes allow (`check_resume`), the state and the data iterator
restored where the checkpoint left them (`restore_state`, `restore_data`), and the data state every process saves
(`all_streams`). Refusals are one line that says what to pass (`--resume-with-changes`, the overrides that keep
the checkpoint's schedule)."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxlong import data as data_lib
from jaxlong.config import Config, ConfigError, to_dict
from jaxlong.core.distributed import allgather_json
from jaxlong.training import step as step_lib
from jaxlong.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    StateMismatch,
    config_changes,
    mismatch_message,
    param_shape_mismatches,
    saved_config,
)

__all__ = ["check_resume", "check_resume_config", "resume_refusal", "restore_state", "restore_data", "all_streams"]


def check_resume_config(cfg: Config, saved: dict, step: int, allow_changes: bool = False) -> list[str]:
    """The changes (`key: old -> new`, `jaxlong.training.checkpoint.config_changes`) from checkpoint `step`'s config
    `saved` (a nested dict of `jaxlong.config.to_dict`) to `cfg` that a resume may not make.

    Raises:
      ConfigError: there are such changes and not `allow_changes` (`--resume-with-changes`); the message is
        `resume_refusal`'s line.
    """
    changes = config_changes(saved, to_dict(cfg), to_dict(Config()))
    if changes and not allow_changes:
        raise ConfigError(resume_refusal(cfg, step, changes, saved_steps=saved.get("steps")))
    return changes


def resume_refusal(cfg: Config, step: int, changes: list[str], saved_steps: int | None = None) -> str:
    """The one line that refuses `--resume` with `changes` (`key: old -> new`, from `config_changes`) and says what
    to pass. A new `steps=` (the checkpoint's was `saved_steps`) with `optim.decay_steps=0` changes the schedule's
    length (`jaxlong.optim.adamw.schedule_length`): the line then names the overrides that keep the checkpoint's
    schedule, `optim.decay_steps=<its length>` and every other changed key set back (`key=<old>`); with them the
    same command resumes (the length is above the checkpoint's warmup, so the config validates)."""
    decay = next((c for c in changes if c.startswith("optim.decay_steps: ")), None)
    if decay is not None and not cfg.optim.decay_steps and saved_steps not in (None, cfg.steps):
        old = decay.split(": ", 1)[1].split(" -> ")[0]
        rest = [c for c in changes if c is not decay]
        keep = [f"optim.decay_steps={old}", *(_set_back(c) for c in rest)]
        also = f"; it also changes {'; '.join(rest)}" if rest else ""
        return (f"--resume: steps={cfg.steps} would change checkpoint {step}'s learning-rate schedule (its warmup "
                f"and cosine decay run over {old} steps, and optim.decay_steps=0 follows steps){also}; add "
                f"{' '.join(keep)} to keep the checkpoint's schedule and train on, or pass --resume-with-changes to "
                f"change it")
    return (f"--resume: this config differs from checkpoint {step}'s in keys that change the model, the data stream "
            f"or the schedule: {'; '.join(changes)}; set them back, or pass --resume-with-changes")


def _set_back(change: str) -> str:
    """`key: old -> new` (from `config_changes`, values as JSON) as the override `key=old`."""
    key, values = change.split(": ", 1)
    return f"{key}={values.split(' -> ')[0]}"


def check_resume(cfg: Config, mesh, ckpt_dir: Path, step: int, allow_changes: bool, say=print) -> None:
    """Before the compile, and before orbax reads anything: the parameter shapes of checkpoint `step` against
    `cfg`'s (no flag resumes into other shapes), then its config (`check_resume_config`); the changes a resume makes
    are said (a recipe's next stage names them as its own).

    Raises:
      ConfigError: other shapes (the changed `model.*` keys named), or changes that need `--resume-with-changes`.
    """
    saved = saved_config(ckpt_dir, step)
    mismatches = param_shape_mismatches(ckpt_dir, step, step_lib.abstract_state(cfg, mesh))
    if mismatches:
        err = StateMismatch(step, ckpt_dir, mismatches)
        raise ConfigError("--resume: " + mismatch_message(err, saved, to_dict(cfg), to_dict(Config())))
    if saved is None:
        say(f"note: checkpoint {step} holds no config; resuming without comparing configs")
        return
    changes = check_resume_config(cfg, saved, step, allow_changes)
    if changes and saved.get("stage", 0) != cfg.stage:  # a recipe's next stage (jaxlong.recipes.recipe)
        say(f"stage {cfg.stage} changes from checkpoint {step}: {'; '.join(changes)}")
    elif changes:
        say(f"--resume-with-changes: resuming checkpoint {step} with {'; '.join(changes)}")


def restore_state(ckpt: Checkpointer, abstract: dict, step: int) -> dict:
    """The train state of checkpoint `step` in the shardings of `abstract`.

    Raises:
      ConfigError: a mislabelled or mismatched checkpoint, or one orbax cannot read into this config's state.
    """
    try:
        return ckpt.restore(abstract, step)[1]
    except CheckpointError as e:  # a mislabelled or mismatched checkpoint: input the run cannot use
        raise ConfigError(f"--resume: {e}") from None
    except Exception as e:  # noqa: BLE001 (orbax reports shape mismatches with long tracebacks)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"--resume: checkpoint {step} could not be restored into this config's train state ({type(e).__name__}: "
            f"{first[:300]}); its files may be incomplete, or the optimizer state differs from the checkpoint's"
        ) from e


def restore_data(batches, data_state: dict | None, start: int) -> None:
    """Continue the data iterator where a checkpoint left it: from its saved state, or, for a checkpoint without
    one (or one that lacks this process's packing streams), by replaying the `start` batches it consumed (since
    its stage began)."""
    if data_state is not None:
        try:
            batches.set_state(data_state)
            return
        except ValueError as e:
            print(f"note (process {jax.process_index()}): {e}; replaying the {start} batches instead")
    for _ in range(start):
        next(batches)


def all_streams(batches, data_state: dict) -> dict:
    """The data state of every packing stream (of `batches`), merged from all processes (a collective; what a
    checkpoint saves, so that any process layout resumes from it)."""
    return getattr(batches, "merge_states", data_lib.merge_states)(allgather_json(data_state))

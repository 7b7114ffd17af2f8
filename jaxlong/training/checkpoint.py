"""Checkpoints with orbax: asynchronous, atomic (written to `<step>.orbax-checkpoint-tmp`, then renamed to
`<step>/`), keeping the last K. A checkpoint holds the train state, the config it was written with and the
input pipeline's iterator state (`data`, Grain's JSON state, see `jaxlong.data.pipeline`), so `--resume`
continues with exactly the next batch.

A checkpoint's label is always the `step` counter of the state it holds (`int(state['step'])`), never a loop
variable. When to save is orbax's save-decision policy: every `every` steps, the final step, and orbax's own
preemption sync point (multi-host runs with `jax.distributed`'s preemption service). A save that fails (while
starting, or while committing in the background) raises `CheckpointError` and leaves no temporary directory;
temporary directories left by a killed process are removed when the next `Checkpointer` opens the directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocp_policy

from jaxlong.config import Config, ConfigError, to_dict
from jaxlong.optim.adamw import schedule_length
from jaxlong.training.step import abstract_params

TMP_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix for a checkpoint still being written


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or committed (the message says which step and why)."""


class StateMismatch(CheckpointError):
    """A checkpoint's parameters do not have the shapes the config asks for; `mismatches` lists them as
    `params/<path>: saved [..], this config [..]`. Raised before orbax reads any array."""

    def __init__(self, step: int, directory: Path, mismatches: list[str]):
        self.step, self.mismatches = step, mismatches
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        super().__init__(f"checkpoint {directory / str(step)} does not fit this config's parameters: "
                         f"{mismatches[0]}{more}")


def param_shape_mismatches(directory: str | Path, step: int, abstract_state: dict) -> list[str]:
    """`params/<path>: saved [..], this config [..]` for every parameter whose shape or dtype in checkpoint
    `step`'s metadata differs from `abstract_state['params']` (or that only one of them has). Reads only the
    checkpoint's metadata file; an unreadable metadata gives `[]` (orbax's restore then reports)."""
    path = Path(directory) / str(step) / "state"
    try:
        saved = ocp.StandardCheckpointHandler().metadata(path)
        saved = getattr(saved, "tree", saved)
        saved = {jax.tree_util.keystr(p): leaf for p, leaf in
                 jax.tree_util.tree_flatten_with_path(dict(saved)["params"])[0]}
    except Exception:  # noqa: BLE001 (a format orbax reads differently: leave the check to the restore)
        return []
    want = {jax.tree_util.keystr(p): leaf for p, leaf in
            jax.tree_util.tree_flatten_with_path(abstract_state["params"])[0]}

    def show(leaf) -> str:
        return "absent" if leaf is None else f"{list(leaf.shape)} {getattr(leaf, 'dtype', '')}".strip()

    out = []
    for key in sorted(set(saved) | set(want)):
        a, b = saved.get(key), want.get(key)
        if a is None or b is None or tuple(a.shape) != tuple(b.shape):
            out.append(f"params{key}: saved {show(a)}, this config {show(b)}")
    return out


def committed_steps(directory: str | Path) -> list[int]:
    """Sorted steps of the committed checkpoints in `directory` (renamed from their temporary name); creates
    nothing."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists())


def remove_tmp_dirs(directory: str | Path) -> list[str]:
    """Delete the temporary directories of unfinished saves in `directory`; returns their names."""
    path = Path(directory)
    if not path.is_dir():
        return []
    names = [p.name for p in path.iterdir() if TMP_MARK in p.name]
    for name in names:
        shutil.rmtree(path / name, ignore_errors=True)
    return names


def saved_config(directory: str | Path, step: int) -> dict | None:
    """The config (a nested dict, as written by `jaxlong.config.to_dict`) saved with checkpoint `step`; None when
    the checkpoint has none."""
    path = Path(directory) / str(step) / "config" / "metadata"
    if not path.is_file():
        return None
    return json.loads(path.read_text())


class Checkpointer:
    """Saves the train state under `directory/<state step>/` every `every` steps and at `final_step`, keeping
    the last `keep`."""

    def __init__(self, directory: str | Path, *, every: int, keep: int, final_step: int | None = None):
        self.directory = Path(directory).absolute()
        if jax.process_index() == 0:  # leftovers of a killed run; orbax's own cleanup runs in the background
            remove_tmp_dirs(self.directory)
        policies = [ocp_policy.FixedIntervalPolicy(every), ocp_policy.PreemptionCheckpointingPolicy()]
        if final_step is not None:
            policies.append(ocp_policy.SpecificStepsPolicy((final_step,)))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True, cleanup_tmp_directories=True,
            save_decision_policy=ocp_policy.AnySavePolicy(policies),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.pending: int | None = None  # step of the save started last, until it is known committed

    @staticmethod
    def latest_in(directory: str | Path) -> int | None:
        """Latest committed checkpoint step in `directory` (None if there is none); creates nothing."""
        return max(committed_steps(directory), default=None)

    def should_save(self, step: int) -> bool:
        """Whether orbax's policy saves `step` (interval, final step, or a reached preemption sync point)."""
        return self.manager.should_save(step)

    def save(self, state: dict, config: dict, *, force: bool = False, data_state: dict | None = None) -> int | None:
        """Start an asynchronous save of `state` (if the policy saves its step, or `force`) under the label
        `int(state['step'])`, with the data iterator's state `data_state` (a JSON-serializable dict) when given.
        Returns that step, or None when nothing was saved (not due, or already saved).

        The device-to-host copy happens before this returns, so `state` may then be donated to the next step.

        Raises:
          CheckpointError: the save could not start; the temporary directory is removed.
        """
        step = int(state["step"])
        if step in committed_steps(self.directory) or (not force and not self.should_save(step)):
            return None
        self.wait()  # one save in flight at a time: its failure is reported before the next starts
        try:
            items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config))
            if data_state is not None:
                items["data"] = ocp.args.JsonSave(data_state)
            if not self.manager.save(step, args=ocp.args.Composite(**items), force=True):
                raise CheckpointError(f"orbax declined to save step {step}")
        except CheckpointError:
            remove_tmp_dirs(self.directory)
            raise
        except Exception as e:  # noqa: BLE001 (any failure of the storage layer)
            remove_tmp_dirs(self.directory)
            raise CheckpointError(f"could not save step {step}: {type(e).__name__}: {e}") from e
        self.pending = step
        return step

    def wait(self) -> int | None:
        """Block until the pending asynchronous save is committed; returns the latest committed step.

        Raises:
          CheckpointError: the background commit failed (its temporary directory is removed).
        """
        pending, self.pending = self.pending, None
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            remove_tmp_dirs(self.directory)
            raise CheckpointError(f"could not commit step {pending}: {type(e).__name__}: {e}") from e
        latest = self.latest_in(self.directory)
        if pending is not None and pending not in committed_steps(self.directory):
            remove_tmp_dirs(self.directory)
            raise CheckpointError(f"step {pending} was not committed (no {self.directory / str(pending)})")
        return latest

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[int, dict]:
        """Restore the state at `step` (default: latest) into the shardings of `abstract_state`.

        Raises:
          FileNotFoundError: there is no checkpoint in the directory.
          StateMismatch: the checkpoint's parameter shapes differ from `abstract_state`'s (checked on the
            metadata, before any array is read).
          CheckpointError: the checkpoint's `state['step']` differs from its label.
        """
        step = self.latest_in(self.directory) if step is None else step
        if step is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {self.directory}")
        mismatches = param_shape_mismatches(self.directory, step, abstract_state)
        if mismatches:
            raise StateMismatch(step, self.directory, mismatches)
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )["state"]
        if int(restored["step"]) != step:
            raise CheckpointError(
                f"checkpoint {self.directory / str(step)} holds state step {int(restored['step'])}, not {step}"
            )
        return step, restored

    def restore_data(self, step: int) -> dict | None:
        """The data iterator state saved at `step`, or None when that checkpoint has none."""
        if not (self.directory / str(step) / "data").exists():
            return None
        return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

    def close(self) -> None:
        """Wait for the pending save and close the manager (also when the wait fails).

        Raises:
          CheckpointError: as `wait`.
        """
        try:
            self.wait()
        finally:
            self.manager.close()


# ----------------------------------------------------------------------------------------------
# What a resume may change.

# Config keys a resume may change freely: the layout of the computation (mesh axes, remat, tiling, attention
# method; the state is resharded on restore), logging and checkpointing, and `steps` (extending a run). Every
# other key, including keys added later, must equal the checkpoint's (deny by default).
RESUMABLE_KEYS = ("mesh.*", "remat.*", "tiling.*", "attention.*", "run_name", "run_dir", "log_every",
                  "checkpoint_every", "keep_checkpoints", "profile_steps", "steps", "ruler_tasks", "ruler_lengths",
                  "ruler_cases", "ruler_scoring", "prefill_chunk", "lost_process_timeout_s",
                  "data.read_threads", "data.read_buffer", "data.doc_lengths",  # doc_lengths: plans only
                  "imported.*")  # imported: checked file by file


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resumable(key: str) -> bool:
    return any(key == p or (p.endswith(".*") and key.startswith(p[:-1])) for p in RESUMABLE_KEYS)


def config_changes(saved: dict, new: dict, defaults: dict) -> list[str]:
    """`key: old -> new` for every config key that differs between a checkpoint's config and the resuming run's
    and may not change on resume (anything outside `RESUMABLE_KEYS`).

    `saved`, `new`, `defaults`: nested dicts as written by `jaxlong.config.to_dict`; a key missing from `saved`
    (a checkpoint written before the option existed) compares as its default. `optim.decay_steps` compares as
    the schedule's length (`jaxlong.optim.adamw.schedule_length`: `decay_steps or steps`, at least `warmup_steps + 1`),
    so extending `steps` of a run whose decay length was `steps` is a schedule change, while extending one with
    an explicit `optim.decay_steps`, or one whose schedule the warmup made longer than the new `steps`, is not.
    """
    flat_defaults = _flatten(defaults)
    old = {**flat_defaults, **_flatten(saved)}
    cur = {**flat_defaults, **_flatten(new)}
    for d in (old, cur):
        if "optim.decay_steps" in d:
            d["optim.decay_steps"] = schedule_length(d["steps"] - d.get("optim.schedule_start", 0),
                                                     d["optim.warmup_steps"], d["optim.decay_steps"])
    missing = object()
    changes = []
    for key in sorted(set(old) | set(cur)):
        a, b = old.get(key, missing), cur.get(key, missing)
        if a != b and not _resumable(key):
            show = lambda v: "(absent)" if v is missing else json.dumps(v)  # noqa: E731
            changes.append(f"{key}: {show(a)} -> {show(b)}")
    return changes


def mismatch_message(err: StateMismatch, saved: dict | None, new: dict, defaults: dict) -> str:
    """One line for a `StateMismatch`: the first parameter that differs and the `model.*` keys whose values
    differ between the checkpoint's config (`saved`, None if it has none) and this one (`new`; both nested
    dicts of `jaxlong.config.to_dict`, with `defaults` for keys a checkpoint lacks)."""
    keys = [c for c in config_changes(saved, new, defaults) if c.startswith("model.")] if saved else []
    more = f" and {len(err.mismatches) - 1} more" if len(err.mismatches) > 1 else ""
    named = (f"the model keys differ from the checkpoint's: {'; '.join(keys)}" if keys else
             "the model config differs from the one it was saved with")
    return (f"checkpoint {err.step} holds parameters of other shapes ({err.mismatches[0]}{more}): {named}; a "
            f"checkpoint restores only into the model it was saved with, so set {'these keys' if keys else 'it'} back")



def restore_params(directory: str | Path, step: int, abstract_params: dict) -> dict:
    """The parameters of checkpoint `step` in `directory`, restored alone into the shapes, dtypes and shardings of
    `abstract_params` (`jaxlong.training.step.abstract_params`): the optimizer state is not read. What evaluation,
    generation and export take from a checkpoint.

    Raises:
      StateMismatch: the checkpoint's parameter shapes differ (checked on its metadata first).
      Exception: what orbax raises for a checkpoint it cannot read.
    """
    directory = Path(directory).absolute()
    mismatches = param_shape_mismatches(directory, step, {"params": abstract_params})
    if mismatches:
        raise StateMismatch(step, directory, mismatches)
    item = {"params": abstract_params}
    args = ocp.args.PyTreeRestore(item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(directory / str(step) / "state", args=args)["params"]


def restore_weights(cfg, mesh, directory: str | Path, step: int, hint: str = "") -> dict:
    """`restore_params` of checkpoint `step` in `directory` into `cfg`'s parameters on `mesh`
    (`jaxlong.training.step.abstract_params`), with one-line errors.

    Raises:
      ConfigError: the shapes differ (the message names the changed `model.*` keys, then `hint`), or orbax cannot
        read the checkpoint.
    """
    try:
        return restore_params(directory, step, abstract_params(cfg, mesh))
    except StateMismatch as e:
        raise ConfigError(mismatch_message(e, saved_config(directory, step), to_dict(cfg), to_dict(Config())) + hint
                          ) from None
    except Exception as e:  # noqa: BLE001 (orbax's errors are long; one line names the checkpoint)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ConfigError(f"checkpoint {Path(directory) / str(step)} could not be restored "
                          f"({type(e).__name__}: {first})") from None

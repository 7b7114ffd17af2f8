"""The trainer: `run(cfg, objective=..., hooks=[...])` trains for `steps` steps (Levanter's shape: the trainer knows
no model internals and no evaluation; it takes an objective and hooks).

It starts the run (`jaxlong.training.start`: mesh, resume checks, data, the hooks' start, the compiled step and its
memory report, the state, the objective's preparation), then steps it (`jaxlong.training.stepping`: batches already
sharded on the mesh, metrics, hooks, checkpoints, the stop on SIGTERM/SIGINT). It writes TensorBoard scalars under
`<run_dir>/<run_name>/`: `loss`, `lr`, `grad_norm`, `tokens_trained` (targets the loss counted in the step),
`tokens_per_s`, `step_time_s`, `mfu` (when the device's peak is known), `device_memory/*` (where the backend reports
it), `packing_efficiency` (the fraction of tokens that are not padding), `seq_len` and `stage` (a recipe's stage
index, `jaxlong.recipes.recipe`), the objective's metrics (DPO's `rewards/...`), and with `data.sources`
`data/share/NAME` (each source's share of the tokens fed to process 0 since the run started or resumed, padding
excluded: `jaxlong.data.mixture`), `data/loss/NAME` and `data/tokens_trained/NAME` (the step's loss over each
source's counted targets). Validation and RULER (`eval/...`) are hooks the train command adds
(`jaxlong.recipes.train`). In a multi-process run only process 0 prints, writes TensorBoard and shows the progress
bar.
"""

from __future__ import annotations

from typing import Sequence

from jaxlong.config import Config
from jaxlong.core.distributed import say
from jaxlong.objectives.base import Objective
from jaxlong.training.batches import BatchFn
from jaxlong.training.checkpoint import Checkpointer, remove_tmp_dirs
from jaxlong.training.faults import FAULT_ENV, FAULT_POINTS, FaultInjector
from jaxlong.training.hooks import Hook
from jaxlong.training.signals import Preempted, Signals
from jaxlong.training.start import begin, check_fits, initial_state
from jaxlong.training.stepping import latest_checkpoint_text, train

__all__ = ["run", "Preempted", "FAULT_ENV", "FAULT_POINTS", "check_fits", "latest_checkpoint_text"]


def run(cfg: Config, *, objective: Objective | None = None, hooks: Sequence[Hook] = (), batches: BatchFn | None = None,
        resume: bool = False, profile: bool = False, allow_changes: bool = False, fault=None) -> dict:
    """Train for `cfg.steps` steps (fewer where a hook requests a stop, `StepContext.request_stop`). Returns
    `{"metrics": the last logged metrics, "run_dir", "step": the last step done, "stopped": a hook's reason or
    None}`.

    Args:
      cfg: the run's config.
      objective: the loss (`jaxlong.objectives.base.Objective`; default the one `objective` names).
      hooks: `jaxlong.training.hooks.Hook`s: each one's `start` when the run starts, before anything compiles; its
        `fn` between steps, every `every` steps and after the last, before the step's checkpoint is saved.
      batches: `jaxlong.training.batches.BatchFn` (`batches(step, rows)`, a function of the global step) in place
        of the corpus pipeline as the source of the training batches (the corpus is then read only for validation,
        when `eval_every` > 0).
      resume: continue the run's latest checkpoint; its saved config must equal `cfg` except for the keys in
        `jaxlong.training.checkpoint.RESUMABLE_KEYS`, unless `allow_changes` (`--resume-with-changes`).
      profile: trace `profile_steps` steps with `jax.profiler` into the run directory.
      fault: `fault(point, step)`, called at each of `jaxlong.training.faults.FAULT_POINTS` (default: the
        `JAXLONG_FAULT` injector).

    Raises:
      ConfigError: the config is invalid for the devices present, or differs from the checkpoint's (checked
        before loading data and compiling).
      FileNotFoundError: `resume` with no checkpoint in the run directory.
      ValueError: the corpus cannot be read or is too small (before compiling).
      CheckpointError: a checkpoint could not be written (no partial checkpoint is left).
      Preempted: (a KeyboardInterrupt) on SIGTERM/SIGINT, after saving the last finished step.
    """
    fault = fault or FaultInjector()
    with Signals() as signals:
        begun = begin(cfg, objective, hooks, batches, resume=resume, allow_changes=allow_changes)
        if isinstance(begun, dict):  # nothing to do
            return begun
        fault("after_compile", begun.start + 1)
        cfg = begun.cfg
        ckpt = Checkpointer(begun.ckpt_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints,
                            final_step=cfg.steps)
        try:
            state = initial_state(begun, ckpt, batches)
            signals.deferred = True  # from here on a signal stops the loop between steps
            fault("after_state", begun.start + 1)
            return train(begun, ckpt, state, hooks, signals, fault, profile)
        finally:
            signals.deferred = False
            try:
                ckpt.manager.close()  # `train` has waited for its saves and reported their failures
            except Exception as e:  # noqa: BLE001 (a failure already reported; never hide the original error)
                remove_tmp_dirs(ckpt.directory)
                say(f"closing the checkpoint manager: {type(e).__name__}: {e}")

"""The train loop: data, ahead-of-time compile with a memory report, steps, metrics, checkpoints, profile.

The trainer knows no model internals: it builds the mesh, the state and the jitted step from `jaxlong.training.step`,
feeds batches already sharded on the mesh, and writes TensorBoard scalars under `<run_dir>/<run_name>/`:
`loss`, `lr`, `grad_norm`, `tokens_trained` (targets the loss counted in the step), `tokens_per_s`, `step_time_s`, `mfu` (when the device's peak is known),
`device_memory/*` (where the backend reports it), `packing_efficiency` (the fraction of tokens that are not
padding), `seq_len` and `stage` (a recipe's stage index, `jaxlong.training.recipe`), with `data.sources` `data/share/NAME` (each source's share of the tokens fed to process 0 since the
run started or resumed, padding excluded: `jaxlong.data.mixture`), `data/loss/NAME` and `data/tokens_trained/NAME`
(the step's loss over each source's counted targets: a chat source's assistant tokens apart from a text source's), and every `eval_every` steps `eval/loss` and `eval/perplexity` on held-out documents
(`jaxlong.evaluation.steps.Validator`), with `ruler_tasks` RULER scores `eval/ruler_<scoring>/...`
(`jaxlong.evaluation.ruler.RulerValidator`, built before anything compiles), both run by the validation hook
(`jaxlong.training.hooks`; `run(cfg, hooks=...)` adds others). In a multi-process run only process 0 prints,
writes TensorBoard and shows the progress bar.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

from jaxlong import data as data_lib
from jaxlong import evaluation as eval_lib
from jaxlong.evaluation import ruler
from jaxlong.generation.generate import stop_ids
from jaxlong.config import Config, ConfigError, to_dict, validate
from jaxlong.core import liveness, xla_log
from jaxlong.core.memstats import compiled_bytes, device_memory, format_compiled
from jaxlong.core.distributed import allgather_json
from jaxlong.core.mesh import build_mesh, check_process_layout, describe_param_sharding, run_devices
from jaxlong.core.units import fmt_bytes
from jaxlong.data.imported import keep_chat_template, keep_imported
from jaxlong.models import hf
from jaxlong.training import step as step_lib
from jaxlong.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    StateMismatch,
    config_changes,
    mismatch_message,
    param_shape_mismatches,
    remove_tmp_dirs,
    saved_config,
)
from jaxlong.training.batches import BatchFn, StepBatches
from jaxlong.training.hooks import Hook, StepContext, validation_hook
from jaxlong.training.metrics import flops_per_token, peak_flops
from jaxlong.training.reference import check_reference, needs_reference, prepare_reference


def _say(*args, **kwargs) -> None:
    """`print` on process 0 only (the other processes of a multi-process run stay quiet)."""
    if jax.process_index() == 0:
        print(*args, **kwargs)


def check_fits(compiled, devices: int | None = None) -> None:
    """Raise ConfigError before allocating anything when the compiled step cannot fit device memory.

    Uses the device's `bytes_limit` where the backend reports one (GPUs); the CPU reports none, and there the
    `devices` simulated devices of the mesh (default: all) share the host's memory.
    """
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    need = compiled_bytes(compiled)["peak"]
    if limit is None and jax.default_backend() == "cpu":  # simulated devices share the host's memory
        need *= devices or len(jax.devices())
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if limit and need > limit:
        raise ConfigError(
            f"the train step needs {fmt_bytes(need)} per device but the device has {fmt_bytes(limit)} "
            f"(on the CPU: all simulated devices together against host memory); "
            f"lower seq_len, or add remat.policy=offload, tiling.loss=true, tiling.mlp=true, attention.impl=upipe "
            f"(plan with: python -m jaxlong.memory --ladder)"
        )


def check_state_fits_host(cfg: Config, mesh) -> None:
    """On the CPU, refuse before compiling a run whose train state alone (parameters, AdamW moments and gradients,
    all simulated devices together) exceeds host memory: a GPU-sized model (e.g. `configs/llama3_1_8b.yaml`)
    would otherwise spend minutes compiling first.

    Raises:
      ConfigError: naming the state's size, the host's memory and what to run instead.
    """
    if jax.default_backend() != "cpu":
        return
    state = step_lib.abstract_state(cfg, mesh)
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    need += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))  # the gradients
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > host:
        raise ConfigError(
            f"{cfg.model.name} needs {fmt_bytes(need)} for its train state alone (parameters, gradients and AdamW "
            f"moments) and this machine has {fmt_bytes(host)} with no GPU: it is sized for GPUs; plan it here with "
            f"python -m jaxlong.memory --target h100 (the same config and overrides), and train it on the GPUs"
        )


class Preempted(KeyboardInterrupt):
    """The run stopped on SIGTERM or SIGINT (`signum`) after saving its last finished step."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class _Signals:
    """SIGTERM/SIGINT while training: before the train state exists a signal stops the run at once (nothing is
    lost); once the loop runs (`deferred`), the handler only records the signal, and the loop stops between
    steps, when the state of the last finished step is bound, and saves it. Installed only in the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: int | None = None
        self.deferred = False
        self._previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, frame):
        if not self.deferred:
            raise Preempted(signum)
        if self.received is None:
            tqdm.write(f"received {signal.Signals(signum).name}: stopping after the current step, then saving it")
        self.received = self.received or signum  # the first signal names the stop


# Testing hook (fault injection): JAXLONG_FAULT="<point>@<step>:<SIGNAL>[,...]", e.g. "after_step@4:SIGTERM",
# makes the trainer send SIGNAL to its own process when it reaches the named point of `run` while computing
# `step` (1-based), once per entry. The points are the names passed to `fault` below (FAULT_POINTS);
# tests/test_faults.py kills the trainer at each of them.
FAULT_ENV = "JAXLONG_FAULT"
FAULT_POINTS = ("after_compile", "after_state", "before_batch", "before_put", "before_dispatch", "after_step",
                "after_bind", "before_metrics", "during_metrics", "during_log", "before_save", "during_save",
                "end_of_step", "after_loop", "during_final_save", "after_commit")


def _fault_plan() -> list[tuple[str, int, int]]:
    plan = []
    for entry in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        where, sig = entry.strip().rsplit(":", 1)
        point, step = where.split("@")
        if point not in FAULT_POINTS:
            raise ValueError(f"{FAULT_ENV}: unknown point {point!r}; points: {', '.join(FAULT_POINTS)}")
        plan.append((point, int(step), int(getattr(signal, sig))))
    return plan


def run(cfg: Config, *, resume: bool = False, profile: bool = False, allow_changes: bool = False,
        hooks: Sequence[Hook] = (), batches: BatchFn | None = None) -> dict:
    """Train for `cfg.steps` steps (fewer where a hook requests a stop, `StepContext.request_stop`). Returns
    `{"metrics": the last logged metrics, "run_dir", "step": the last step done, "stopped": a hook's reason or
    None}`.

    `resume` continues the run's latest checkpoint; its saved config must equal `cfg` except for the keys in
    `jaxlong.training.checkpoint.RESUMABLE_KEYS`, unless `allow_changes` (`--resume-with-changes`). `hooks`
    (`jaxlong.training.hooks.Hook`) run between steps after the run's own (validation and RULER every
    `eval_every` steps), before the step's checkpoint is saved. `batches` (`jaxlong.training.batches.BatchFn`:
    `batches(step, rows)`, a function of the global step) replaces the corpus pipeline as the source of the
    training batches (the corpus is then read only for validation, when `eval_every` > 0).

    Raises:
      ConfigError: the config is invalid for the devices present, or differs from the checkpoint's (checked
        before loading data and compiling).
      FileNotFoundError: `resume` with no checkpoint in the run directory.
      ValueError: the corpus cannot be read or is too small (before compiling).
      CheckpointError: a checkpoint could not be written (no partial checkpoint is left).
      Preempted: (a KeyboardInterrupt) on SIGTERM/SIGINT, after saving the last finished step.
    """
    plan = _fault_plan()

    def fault(point: str, step: int) -> None:
        for entry in [e for e in plan if e[:2] == (point, step)]:
            plan.remove(entry)
            os.kill(os.getpid(), entry[2])

    with _Signals() as signals:
        return _run(cfg, resume, profile, allow_changes, signals, fault, hooks, batches)


def _run(cfg: Config, resume: bool, profile: bool, allow_changes: bool, signals: _Signals, fault,
         extra_hooks: Sequence[Hook], batch_fn: BatchFn | None) -> dict:
    try:
        devices = run_devices(cfg.mesh)  # their platform: the GPU kernels' limits where attention.backend=auto
        validate(cfg, num_devices=len(devices), platform=devices[0].platform)
    except ConfigError as e:
        if jax.process_count() == 1:
            raise
        raise ConfigError(f"{e} (this launch: {jax.process_count()} processes of {jax.local_device_count()} devices "
                          f"each)", key=e.key, value=e.value, keys=e.keys, suggestions=e.suggestions) from None
    if cfg.attention.backend in ("cudnn", "pallas") and jax.default_backend() != "gpu":
        raise ConfigError(
            f"attention.backend={cfg.attention.backend} needs an NVIDIA GPU, but jax runs on {jax.default_backend()}; "
            f"use attention.backend=auto (cuDNN where available) or blockwise"
        )
    mesh = build_mesh(cfg.mesh)
    check_process_layout(mesh)
    run_dir = Path(cfg.run_dir) / cfg.run_name
    ckpt_dir = run_dir / "checkpoints"
    latest = Checkpointer.latest_in(ckpt_dir)
    if cfg.model.from_hf and not resume:  # its tensors are checked before compiling (a resume has its weights)
        hf.check_checkpoint(cfg.model.from_hf, cfg)
    check_reference(cfg)  # a DPO reference given as a Hugging Face directory
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint found in {ckpt_dir.absolute()}")
    if not resume and latest is not None:
        raise ConfigError(
            f"run_name={cfg.run_name!r}: {ckpt_dir} already holds checkpoints (up to step {latest}); "
            f"pass --resume to continue it, or choose a new run_name"
        )
    if resume:  # before the compile, and before orbax reads anything
        _check_resume_shapes(cfg, mesh, ckpt_dir, latest)  # first: no flag resumes into other shapes
        _check_resume_config(cfg, ckpt_dir, latest, allow_changes)
    start = latest or 0
    if start >= cfg.steps:
        _say(f"nothing to do: the latest checkpoint is step {start} and steps={cfg.steps}; "
              f"pass steps=N with N > {start} to train further")
        return {"metrics": {}, "run_dir": str(run_dir), "step": start, "stopped": None}
    check_state_fits_host(cfg, mesh)  # before the data and the compile
    run_dir.mkdir(parents=True, exist_ok=True)
    # The run's own copy of its tokenizer files (RUN_DIR/imported/), their digests saved with every checkpoint.
    recorded = (saved_config(ckpt_dir, latest) or {}).get("imported", {}) if resume else None
    cfg = dataclasses.replace(cfg, imported=keep_imported(cfg, run_dir, recorded=recorded,
                                                          write=jax.process_index() == 0, say=_say))
    keep_chat_template(cfg, run_dir, write=jax.process_index() == 0)  # RUN_DIR/chat_template.jinja
    tokenizer = data_lib.run_tokenizer(cfg, run_dir)  # the run's copy, then model.from_hf, then data.tokenizer
    try:
        data_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _say(f"jaxlong: {cfg.model.name}, seq_len {cfg.seq_len}, global batch {cfg.global_batch}, "
          f"mesh {dict(mesh.shape)} on {mesh.size} x {jax.devices()[0].device_kind}, "
          f"attention {cfg.attention.impl}/{cfg.attention.backend}, remat {cfg.remat.policy}")
    # Data first: a bad corpus fails before the (possibly long) compile.
    # data.path, or the first of data.sources (with batches of one's own: for validation only)
    source = data_lib.first_source(cfg, tokenizer) if batch_fn is None or cfg.eval_every else None
    validator, suite_validator, held_out = None, None, ()
    if cfg.eval_every:  # whole documents held out for validation, left out of training
        held_out, eval_batches = eval_lib.validation_split(cfg, source, tokenizer)
        validator = eval_lib.Validator(cfg, mesh, eval_batches)
        suite = ruler.validation_suite(cfg)
        if suite:  # lengths checked, then cases generated now, before anything compiles
            ruler.check_lengths(cfg, suite.lengths, "ruler_lengths", cases=suite.cases, tasks=len(suite.tasks))
            corpus = ruler.suite_corpus(suite, (source[i] for i in held_out), tokenizer)
            suite_validator = ruler.RulerValidator(cfg, mesh, tokenizer, suite, corpus, option="ruler_lengths",
                                                   eos_ids=stop_ids(tokenizer, data_lib.tokenizer_source(cfg, run_dir)))
    rows = step_lib.process_rows(mesh, cfg.global_batch)
    dpo = cfg.objective == "dpo" and batch_fn is None  # its batches carry the reference: made once it is known
    if batch_fn is None and not dpo:
        # data.sources: each source's length rules checked here, sources the run repeats heavily warned about
        batches = data_lib.batch_iterator(cfg, tokenizer, source=source, exclude=held_out, rows=rows, warn=_say)
    elif batch_fn is not None:
        batches = StepBatches(batch_fn, rows, cfg.seq_len, cfg.model.vocab_size, start)

    t0 = time.perf_counter()
    with xla_log.collecting() as log:
        compiled = xla_log.compile_logged(step_lib.compile_train_step, cfg, mesh)
    _say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    _say(format_compiled(compiled))
    for line in log.summary():
        _say(line)
    check_fits(compiled, mesh.size)
    if validator:
        _say(format_compiled(validator.compile(), "eval step"))
    fault("after_compile", start + 1)

    ckpt = Checkpointer(ckpt_dir, every=cfg.checkpoint_every, keep=cfg.keep_checkpoints, final_step=cfg.steps)
    try:
        saved = (saved_config(ckpt_dir, start) or {}) if resume else {}
        if resume:
            state = _restore(ckpt, step_lib.abstract_state(cfg, mesh), start)
        elif cfg.model.from_hf:
            state = step_lib.init_state(cfg, mesh, hf.load_params(cfg.model.from_hf, cfg, mesh))
            _say(f"loaded the weights of {cfg.model.from_hf}")
        else:
            state = step_lib.init_state(cfg, mesh)
        if dpo and needs_reference(cfg):  # the frozen reference's log-probs of every pair, once (RUN_DIR/reference/)
            # resumed inside the DPO stage (not at its start: a recipe's next stage, or a run switched to DPO by
            # --resume-with-changes): the weights it started from are gone, its reference file serves
            inside = resume and saved.get("stage", 0) == cfg.stage and saved.get("objective", "lm") == "dpo"
            prepare_reference(cfg, mesh, run_dir, source, tokenizer, None if inside else lambda: state["params"],
                              say=_say)
        if dpo:  # the batches, with the reference's log-probs (none under simpo)
            if validator is not None:
                validator.batches = eval_lib.validation_batches(cfg, source, tokenizer, held_out, cfg.eval_batches)
            batches = data_lib.batch_iterator(cfg, tokenizer, source=source, exclude=held_out, rows=rows, warn=_say)
        if resume:
            if isinstance(batches, StepBatches):
                pass  # a function of the step: it starts after `start` already
            elif saved.get("stage", 0) == cfg.stage:
                _restore_data(batches, ckpt.restore_data(start), start - cfg.optim.schedule_start)
            else:  # a recipe's next stage: its own data from its first batch (jaxlong.training.recipe)
                _say(f"stage {cfg.stage} starts from checkpoint {start}: steps {start + 1}-{cfg.steps}, seq_len "
                     f"{cfg.seq_len}, its data from the start")
            # a fresh optimizer where this config asks for one and the checkpoint's did not, or at a stage's start
            if cfg.optim.reset_state and (saved.get("stage", 0) != cfg.stage or
                                          not saved.get("optim", {}).get("reset_state", False)):
                state = step_lib.reset_optimizer(cfg, mesh, state)
                _say(f"optim.reset_state: a fresh optimizer state from step {start} (AdamW's moments zero)")
            _say(f"resumed from {ckpt.directory / str(start)}")
        signals.deferred = True  # from here on a signal stops the loop between steps
        fault("after_state", start + 1)
        hooks = ([validation_hook(validator, suite_validator)] if validator else []) + list(extra_hooks)
        return _loop(_Loop(cfg, mesh, ckpt, batches, compiled, run_dir, profile, signals, fault, hooks), state, start)
    finally:
        signals.deferred = False
        try:
            ckpt.manager.close()  # `_loop` has waited for its saves and reported their failures
        except Exception as e:  # noqa: BLE001 (a failure already reported; never hide the original error)
            remove_tmp_dirs(ckpt.directory)
            _say(f"closing the checkpoint manager: {type(e).__name__}: {e}")


def latest_checkpoint_text(directory: Path) -> str:
    """`latest complete checkpoint: step N in DIR; relaunch every process with --resume`, or that there is none
    (the end of a lost process's line, `jaxlong.core.liveness.Watchdog`)."""
    step = Checkpointer.latest_in(directory)
    if step is None:
        return f"no complete checkpoint in {directory} yet"
    return f"latest complete checkpoint: step {step} in {directory}; relaunch every process with --resume"


def _restore_data(batches, data_state: dict | None, start: int) -> None:
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


def _all_streams(batches, data_state: dict) -> dict:
    """The data state of every packing stream (of `batches`), merged from all processes (a collective; what a
    checkpoint saves, so that any process layout resumes from it)."""
    return getattr(batches, "merge_states", data_lib.merge_states)(allgather_json(data_state))


def _check_resume_config(cfg: Config, ckpt_dir: Path, step: int, allow_changes: bool) -> None:
    saved = saved_config(ckpt_dir, step)
    if saved is None:
        _say(f"note: checkpoint {step} holds no config; resuming without comparing configs")
        return
    changes = check_resume_config(cfg, saved, step, allow_changes)
    if changes and saved.get("stage", 0) != cfg.stage:  # a recipe's next stage (jaxlong.training.recipe)
        _say(f"stage {cfg.stage} changes from checkpoint {step}: {'; '.join(changes)}")
    elif changes:
        _say(f"--resume-with-changes: resuming checkpoint {step} with {'; '.join(changes)}")


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
    length (`jaxlong.config.schedule_length`): the line then names the overrides that keep the checkpoint's
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


def _check_resume_shapes(cfg: Config, mesh, ckpt_dir: Path, step: int) -> None:
    mismatches = param_shape_mismatches(ckpt_dir, step, step_lib.abstract_state(cfg, mesh))
    if mismatches:
        err = StateMismatch(step, ckpt_dir, mismatches)
        raise ConfigError("--resume: " + mismatch_message(err, saved_config(ckpt_dir, step), to_dict(cfg),
                                                          to_dict(Config())))


def _restore(ckpt: Checkpointer, abstract: dict, step: int) -> dict:
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


@dataclasses.dataclass
class _Loop:
    """What the loop runs with: the validated config, its mesh, the checkpointer, the data iterator, the compiled
    step, the run directory, whether to profile, the signal state, the fault-injection function and the hooks."""

    cfg: Config
    mesh: jax.sharding.Mesh
    ckpt: Checkpointer
    batches: object
    compiled: object
    run_dir: Path
    profile: bool
    signals: _Signals
    fault: Callable[[str, int], None]
    hooks: list[Hook]


def _loop(lp: _Loop, state: dict, start: int) -> dict:
    """Steps `start + 1` .. `cfg.steps` from `state` (the train state after step `start`)."""
    cfg, mesh, ckpt, batches, compiled = lp.cfg, lp.mesh, lp.ckpt, lp.batches, lp.compiled
    run_dir, profile, signals, fault = lp.run_dir, lp.profile, lp.signals, lp.fault
    sharded = describe_param_sharding(mesh, state["params"])
    replicated = [line for line in sharded if "replicated" in line]
    _say(f"FSDP: {len(sharded) - len(replicated)} of {len(sharded)} parameter leaves sharded over fsdp x ring x context"
          + (f"; replicated: {', '.join(r.split()[0] for r in replicated)}" if replicated else ""))

    cfg_dict = to_dict(cfg)
    main = jax.process_index() == 0
    writer = SummaryWriter(str(run_dir), filename_suffix=f".{os.getpid()}.{time.time_ns()}") if main else None
    tokens_per_step = cfg.seq_len * cfg.global_batch
    flops, peak = flops_per_token(cfg), peak_flops()
    metrics: dict = {}
    packed: list[float] = []
    names = [data_lib.source_name(src, i) for i, src in enumerate(cfg.data.sources)]
    profiling = False
    profile_start = start + 1  # skip the first step (allocation, warm-up)
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", dynamic_ncols=True, disable=not main)
    # `done` is the step counter of the bound `state` (int(state['step'])): a signal cannot interrupt between
    # the two assignments below, since the handler only records it.
    # `data_state` is the input pipeline's state after the batch of step `done`: saved with that state.
    done, started, data_state, stopped = start, None, batches.get_state(), None
    several = jax.process_count() > 1
    if liveness.watchdog() is not None:  # a lost process's line names the latest checkpoint
        liveness.watchdog().checkpoints = lambda: latest_checkpoint_text(ckpt.directory)
    try:
        t_last = time.perf_counter()
        while done < cfg.steps:
            # Several processes stop together: after the step where any of them received SIGTERM/SIGINT.
            stop = liveness.agree_stop(done, signals.received) if several else \
                ((0, signals.received) if signals.received is not None else None)
            if stop is not None:
                own, signals.received = signals.received, stop[1]  # every process: the agreed signal
                if own is None and main:  # on its own line, not on the progress bar's
                    bar.write(f"process {stop[0]} received {signal.Signals(stop[1]).name}: every process stops "
                              f"after step {done}, then saves it")
                break
            step = done + 1
            fault("before_batch", step)
            if profile and step == profile_start + 1:
                jax.profiler.start_trace(str(run_dir))
                profiling = True
            host_batch = next(batches)
            host_batch.pop(data_lib.PAIR_FEATURE, None)  # preference pairs: which pair (the reference pass's)
            packed.append(data_lib.packing_efficiency(host_batch))
            if names:  # a mixture: the source of every token, for each source's loss (0: no source)
                host_batch.setdefault(data_lib.SOURCE_FEATURE, np.zeros_like(host_batch["inputs"]))
            fault("before_put", step)
            batch = step_lib.put_batch(host_batch, mesh, batches.rows, cfg.global_batch)
            fault("before_dispatch", step)
            if signals.received is not None and not several:  # several processes stop where they agree
                break
            new_state, m = compiled(state, batch)  # donates `state`
            fault("after_step", step)
            state, done, data_state = new_state, step, batches.get_state()
            fault("after_bind", step)
            if profiling and step == profile_start + cfg.profile_steps:
                jax.block_until_ready(m)
                jax.profiler.stop_trace()
                profiling = False
                if main:  # on its own line, not on the progress bar's
                    bar.write(f"profile of {cfg.profile_steps} steps written under {run_dir}/plugins/profile")
            if done % cfg.log_every == 0 or done == cfg.steps:
                fault("before_metrics", step)
                # replicated scalars: every process reads its own copy (multi-process arrays are not fully
                # addressable, so no device_get of the global array)
                fetched = {k: np.asarray(v.addressable_data(0)) for k, v in m.items()}
                fault("during_metrics", step)
                by_source = {k: fetched.pop(k) for k in ("source_loss", "source_tokens_trained") if k in fetched}
                metrics = {k: float(v) for k, v in fetched.items()}
                for name, loss_, n in zip(names, *by_source.values()):  # each source's loss beside its share
                    if n > 0:  # a step without the source's tokens logs nothing for it
                        metrics[f"data/loss/{name}"], metrics[f"data/tokens_trained/{name}"] = float(loss_), float(n)
                metrics["packing_efficiency"], packed = sum(packed) / max(len(packed), 1), []
                metrics["seq_len"], metrics["stage"] = cfg.seq_len, cfg.stage
                fed = getattr(batches, "source_tokens", list)()  # since the stage began, over resumes
                fed = [*fed, *[0] * (len(names) - len(fed))]
                for name, n in zip(names, fed):  # the realised share of the tokens this process's streams fed
                    metrics[f"data/share/{name}"] = n / max(sum(fed), 1)
                now = time.perf_counter()
                n_steps = min(cfg.log_every, done - start)
                metrics["step_time_s"] = (now - t_last) / n_steps
                metrics["tokens_per_s"] = tokens_per_step / metrics["step_time_s"]
                if peak:
                    metrics["mfu"] = metrics["tokens_per_s"] * flops / (peak * mesh.size)
                for k, v in device_memory().items():
                    metrics[f"device_memory/{k}"] = v
                for i, (k, v) in enumerate(metrics.items()):
                    if writer is not None:
                        writer.add_scalar(k, v, done)
                    if i == 0:
                        fault("during_log", step)
                bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                                packed=f"{metrics['packing_efficiency']:.2f}")
                t_last = now
            due = [h for h in lp.hooks if h.due(done, cfg.steps)]
            if due:
                ctx = StepContext(done, state["params"], metrics, cfg, mesh, writer,
                                  bar.write if main else (lambda line: None))
                for hook in due:
                    hook.fn(ctx)
                if ctx.stop_reason is not None:  # this step is the last: the hooks due after the last run too
                    for hook in [h for h in lp.hooks if all(h is not d for d in due)]:
                        hook.fn(ctx)
                stopped = ctx.stop_reason
            bar.update(1)
            fault("before_save", step)
            if ckpt.should_save(done):
                started = ckpt.save(state, cfg_dict, data_state=_all_streams(batches, data_state)) or started
                if writer is not None:  # the logs of the steps a checkpoint holds survive a SIGKILL with it
                    writer.flush()
                fault("during_save", step)  # the asynchronous commit may still be running
            fault("end_of_step", step)
            if stopped is not None:  # a hook ended the run after this step (saved below)
                break
        fault("after_loop", done)
        try:
            if done > start and started != done:  # interrupted between saves, or a final step the policy skipped
                started = ckpt.save(state, cfg_dict, force=True, data_state=_all_streams(batches, data_state)) or started
                fault("during_final_save", done)
            latest = ckpt.wait()
            fault("after_commit", done)
        except CheckpointError as e:
            if signals.received is None:
                raise
            latest = Checkpointer.latest_in(ckpt.directory)
            if main:
                bar.write(f"{e}; steps {(latest or 0) + 1}..{done} are lost")
    except CheckpointError as e:
        raise CheckpointError(f"{e}; latest committed checkpoint: step {Checkpointer.latest_in(ckpt.directory)}") from e
    finally:
        signals.deferred = False
        if profiling:
            jax.profiler.stop_trace()
        bar.close()
        if writer is not None:
            writer.close()
    if signals.received is not None:
        name = signal.Signals(signals.received).name
        _say(f"stopped by {name} after step {done}; latest committed checkpoint: step {latest}; "
              f"continue with --resume")
        raise Preempted(signals.received, f"stopped by {name} after step {done}")
    ended = f"done: step {cfg.steps}" if stopped is None else f"stopped after step {done} by a hook ({stopped})"
    _say(f"{ended}, loss {metrics.get('loss', float('nan')):.4f}; "
          f"TensorBoard: tensorboard --logdir {cfg.run_dir}; checkpoints in {ckpt.directory}")
    return {"metrics": metrics, "run_dir": str(run_dir), "step": done, "stopped": stopped}

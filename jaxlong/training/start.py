"""Starting a run: everything before the first step, every check before anything compiles.

`begin` validates the config for the devices present, builds the mesh, checks a resume against its checkpoint,
keeps the run's tokenizer files, opens the data and holds out the validation documents, starts the hooks (which
check their options and make their data now), makes the training batches and compiles the train step, printing its
memory. `initial_state` then restores or initializes the state, runs the objective's preparation (DPO's reference
pass) and puts the data iterator where the checkpoint left it. The stepping is `jaxlong.training.stepping`'s.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from jaxlong import data as data_lib
from jaxlong.config import Config, ConfigError, objective_of, run_mesh, runtime
from jaxlong.core import xla_log
from jaxlong.core.batch import process_rows
from jaxlong.core.distributed import say
from jaxlong.core.memstats import compiled_bytes, format_compiled
from jaxlong.core.units import fmt_bytes
from jaxlong.data.heldout import validation_batches, validation_split
from jaxlong.data.imported import keep_chat_template, keep_imported
from jaxlong.models import hf
from jaxlong.models import llama as model_lib
from jaxlong.objectives.base import Objective, Preparation
from jaxlong.training import step as step_lib
from jaxlong.training.batches import BatchFn, StepBatches
from jaxlong.training.checkpoint import Checkpointer, saved_config
from jaxlong.training.hooks import Hook, RunContext
from jaxlong.training.resume import check_resume, restore_data, restore_state

__all__ = ["Begun", "begin", "initial_state", "check_fits", "check_state_fits_host"]


@dataclasses.dataclass
class Begun:
    """A run begun: its validated `cfg` (with the digests of its tokenizer copy), `mesh`, `ckpt_dir`, `start` (the
    step already done), `resume`, the `RunContext` its hooks see, the training `batches` (None until the
    objective's preparation when its batches need it), the batch rows of this process and the compiled step."""

    cfg: Config
    mesh: jax.sharding.Mesh
    ckpt_dir: Path
    start: int
    resume: bool
    run: RunContext
    batches: object
    rows: np.ndarray
    compiled: object


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


def _mesh(cfg: Config) -> jax.sharding.Mesh:
    """The run's mesh (`jaxlong.config.run_mesh`), an explicit GPU kernel refused off GPUs."""
    mesh = run_mesh(cfg)
    if cfg.attention.backend in ("cudnn", "pallas") and jax.default_backend() != "gpu":
        raise ConfigError(
            f"attention.backend={cfg.attention.backend} needs an NVIDIA GPU, but jax runs on {jax.default_backend()}; "
            f"use attention.backend=auto (cuDNN where available) or blockwise"
        )
    return mesh


def _latest(cfg: Config, mesh, objective: Objective, ckpt_dir: Path, resume: bool, allow_changes: bool) -> int:
    """The step a run starts after: its latest checkpoint's when resuming (checked against `cfg` first), else 0;
    the weights it starts from and the objective's files checked before anything compiles.

    Raises:
      FileNotFoundError: `resume` with no checkpoint.
      ConfigError: checkpoints exist and not `resume`; a resume the checkpoint refuses; a bad `model.from_hf`.
    """
    latest = Checkpointer.latest_in(ckpt_dir)
    if cfg.model.from_hf and not resume:  # its tensors are checked before compiling (a resume has its weights)
        hf.check_checkpoint(cfg.model.from_hf, cfg.model)
    objective.check_files(cfg.model)  # e.g. a DPO reference given as a Hugging Face directory
    if resume and latest is None:
        raise FileNotFoundError(f"--resume: no checkpoint found in {ckpt_dir.absolute()}")
    if not resume and latest is not None:
        raise ConfigError(
            f"run_name={cfg.run_name!r}: {ckpt_dir} already holds checkpoints (up to step {latest}); "
            f"pass --resume to continue it, or choose a new run_name"
        )
    if resume:  # before the compile, and before orbax reads anything
        check_resume(cfg, mesh, ckpt_dir, latest, allow_changes, say=say)
    return latest or 0


def _run_context(cfg: Config, mesh, run_dir: Path, objective: Objective, batch_fn: BatchFn | None,
                 resume: bool, ckpt_dir: Path, latest: int) -> RunContext:
    """The run's tokenizer files kept (`RUN_DIR/imported/`, their digests saved with every checkpoint), its
    tokenizer, its data source and, with `eval_every`, the documents held out of training and their batches.

    Raises:
      ConfigError: the tokenizer is larger than `model.vocab_size`.
      ValueError: the corpus cannot be read, or cannot fill the validation batches.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    recorded = (saved_config(ckpt_dir, latest) or {}).get("imported", {}) if resume else None
    main = jax.process_index() == 0
    cfg = dataclasses.replace(cfg, imported=keep_imported(cfg, run_dir, recorded=recorded, write=main, say=say))
    keep_chat_template(cfg, run_dir, write=main)  # RUN_DIR/chat_template.jinja
    tokenizer = data_lib.run_tokenizer(cfg, run_dir)  # the run's copy, then model.from_hf, then data.tokenizer
    data_lib.check_vocab(tokenizer, cfg.model.vocab_size)
    say(f"jaxlong: {cfg.model.name}, seq_len {cfg.seq_len}, global batch {cfg.global_batch}, "
        f"mesh {dict(mesh.shape)} on {mesh.size} x {jax.devices()[0].device_kind}, "
        f"attention {cfg.attention.impl}/{cfg.attention.backend}, remat {cfg.remat.policy}")
    # Data first: a bad corpus fails before the (possibly long) compile.
    # data.path, or the first of data.sources (with batches of one's own: for validation only)
    source = data_lib.first_source(cfg, tokenizer) if batch_fn is None or cfg.eval_every else None
    held_out, batches = validation_split(cfg, source, tokenizer) if cfg.eval_every else ([], [])
    return RunContext(cfg, mesh, run_dir, tokenizer, source, held_out, batches, objective, say)


def _training_batches(begun_cfg: Config, run: RunContext, rows, batch_fn: BatchFn | None, start: int):
    """The training batches: `batch_fn`'s (`StepBatches`), else the corpus pipeline's without the held-out
    documents (a mixture's length rules checked here, heavily repeated sources warned about)."""
    if batch_fn is not None:
        return StepBatches(batch_fn, rows, begun_cfg.seq_len, begun_cfg.model.vocab_size, start,
                           extra_keys=run.objective.batch_keys)
    return data_lib.batch_iterator(begun_cfg, run.tokenizer, source=run.source, exclude=run.held_out, rows=rows,
                                   warn=say)


def begin(cfg: Config, objective: Objective | None, hooks: Sequence[Hook], batch_fn: BatchFn | None, *,
          resume: bool, allow_changes: bool) -> Begun | dict:
    """Everything before the state exists (module docstring): a `Begun`, or the result of a run with nothing to do
    (its latest checkpoint already at `steps`). `objective`: the loss (None: the one the config names).

    Raises: what `jaxlong.training.loop.run` raises before compiling.
    """
    own = () if objective is None else (objective,)  # the step compiles the config's objective unless given one
    objective = objective or objective_of(cfg)
    mesh = _mesh(cfg)
    run_dir = Path(cfg.run_dir) / cfg.run_name
    ckpt_dir = run_dir / "checkpoints"
    start = _latest(cfg, mesh, objective, ckpt_dir, resume, allow_changes)
    if start >= cfg.steps:
        say(f"nothing to do: the latest checkpoint is step {start} and steps={cfg.steps}; "
            f"pass steps=N with N > {start} to train further")
        return {"metrics": {}, "run_dir": str(run_dir), "step": start, "stopped": None}
    check_state_fits_host(cfg, mesh)  # before the data and the compile
    run = _run_context(cfg, mesh, run_dir, objective, batch_fn, resume, ckpt_dir, start)
    for hook in hooks:  # their options checked and their data made before anything compiles
        if hook.start is not None:
            hook.start(run)
    rows = process_rows(mesh, cfg.global_batch)
    prepared = batch_fn is None and objective.prepares_batches  # made once the preparation has run
    batches = None if prepared else _training_batches(run.cfg, run, rows, batch_fn, start)
    t0 = time.perf_counter()
    with xla_log.collecting() as log:
        compiled = xla_log.compile_logged(step_lib.compile_train_step, run.cfg, mesh, *own)
    say(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
    say(format_compiled(compiled))
    for line in log.summary():
        say(line)
    check_fits(compiled, mesh.size)
    return Begun(run.cfg, mesh, ckpt_dir, start, resume, run, batches, rows, compiled)


def initial_state(b: Begun, ckpt: Checkpointer, batch_fn: BatchFn | None) -> dict:
    """The state the first step starts from: restored from checkpoint `b.start` (resuming), or the weights of
    `model.from_hf`, or a fresh initialization; then the objective's preparation (its batches made after it), the
    data iterator continued where the checkpoint left it and, where asked, a fresh optimizer state.

    Raises:
      ConfigError: the checkpoint cannot be restored into this config's state.
      ValueError: the objective's preparation cannot run (e.g. a DPO reference file gone with its weights).
    """
    cfg, mesh, start = b.cfg, b.mesh, b.start
    saved = (saved_config(b.ckpt_dir, start) or {}) if b.resume else {}
    if b.resume:
        state = restore_state(ckpt, step_lib.abstract_state(cfg, mesh), start)
    elif cfg.model.from_hf:
        state = step_lib.init_state(cfg, mesh, hf.load_params(cfg.model.from_hf, cfg.model, mesh, cfg.param_dtype))
        say(f"loaded the weights of {cfg.model.from_hf}")
    else:
        state = step_lib.init_state(cfg, mesh)
    if b.batches is None:  # the objective's preparation, then its batches
        _prepare(b, state, saved)
        if cfg.eval_every:  # the held-out batches carry what it computed (DPO's reference log-probs)
            b.run.validation_batches = validation_batches(cfg, b.run.source, b.run.tokenizer, b.run.held_out,
                                                          cfg.eval_batches)
        b.batches = _training_batches(cfg, b.run, b.rows, batch_fn, start)
    if b.resume:
        if isinstance(b.batches, StepBatches):
            pass  # a function of the step: it starts after `start` already
        elif saved.get("stage", 0) == cfg.stage:
            restore_data(b.batches, ckpt.restore_data(start), start - cfg.optim.schedule_start)
        else:  # a recipe's next stage: its own data from its first batch (jaxlong.recipes.recipe)
            say(f"stage {cfg.stage} starts from checkpoint {start}: steps {start + 1}-{cfg.steps}, seq_len "
                f"{cfg.seq_len}, its data from the start")
        # a fresh optimizer where this config asks for one and the checkpoint's did not, or at a stage's start
        if cfg.optim.reset_state and (saved.get("stage", 0) != cfg.stage or
                                      not saved.get("optim", {}).get("reset_state", False)):
            state = step_lib.reset_optimizer(cfg, mesh, state)
            say(f"optim.reset_state: a fresh optimizer state from step {start} (AdamW's moments zero)")
        say(f"resumed from {ckpt.directory / str(start)}")
    return state


def _prepare(b: Begun, state: dict, saved: dict) -> None:
    """The objective's preparation with the weights the run starts from; resumed inside the objective's stage (not
    at its start: a recipe's next stage, or a run switched to it by --resume-with-changes) they are gone."""
    cfg, mesh = b.cfg, b.mesh
    inside = b.resume and saved.get("stage", 0) == cfg.stage and saved.get("objective", "lm") == cfg.objective
    b.run.objective.prepare(Preparation(
        cfg, b.run.run_dir, b.run.source, b.run.tokenizer, model_lib.model_graphdef(cfg.model, cfg.param_dtype),
        runtime(cfg, mesh), None if inside else (lambda: state["params"]),
        lambda directory: hf.load_params(directory, cfg.model, mesh, cfg.param_dtype), say))



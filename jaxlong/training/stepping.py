"""Stepping a run: steps `start + 1` .. `steps`, each followed by its metrics, its hooks and its checkpoint.

What must happen at an exact point of a step is here: the new state bound with the data state after its batch,
the metrics fetched and logged (`MetricsLog`), the hooks that are due, the checkpoint with the data state of every
process, the stop on SIGTERM/SIGINT between steps (agreed by every process), the profile, and the final save. The
fault callback (`jaxlong.training.faults`) is called at each of `FAULT_POINTS`, at its place in the step.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Callable, Sequence

import jax
import numpy as np
from tensorboardX import SummaryWriter
from tqdm import tqdm

from jaxlong import data as data_lib
from jaxlong.config import Config, to_dict
from jaxlong.core import liveness
from jaxlong.core.batch import put_batch
from jaxlong.core.distributed import say
from jaxlong.core.memstats import device_memory
from jaxlong.core.mesh import describe_param_sharding
from jaxlong.training.checkpoint import Checkpointer, CheckpointError
from jaxlong.training.hooks import Hook, StepContext
from jaxlong.training.metrics import flops_per_token, peak_flops
from jaxlong.training.resume import all_streams
from jaxlong.training.signals import Preempted, Signals
from jaxlong.training.start import Begun

__all__ = ["MetricsLog", "train", "latest_checkpoint_text"]

Fault = Callable[[str, int], None]


def latest_checkpoint_text(directory) -> str:
    """`latest complete checkpoint: step N in DIR; relaunch every process with --resume`, or that there is none
    (the end of a lost process's line, `jaxlong.core.liveness.Watchdog`)."""
    step = Checkpointer.latest_in(directory)
    if step is None:
        return f"no complete checkpoint in {directory} yet"
    return f"latest complete checkpoint: step {step} in {directory}; relaunch every process with --resume"


class MetricsLog:
    """The metrics of the logged steps: fetched from the step's replicated outputs, joined with the data's
    (packing efficiency, each source's share and loss), the speed (tokens/s, MFU where the GPU's peak is known) and
    the device memory, written to TensorBoard (process 0) and shown on the progress bar."""

    def __init__(self, cfg: Config, mesh, run_dir, start: int, main: bool):
        self.cfg, self.mesh, self.start = cfg, mesh, start
        self.writer = SummaryWriter(str(run_dir), filename_suffix=f".{os.getpid()}.{time.time_ns()}") if main else None
        self.tokens_per_step = cfg.seq_len * cfg.global_batch
        self.flops, self.peak = flops_per_token(cfg), peak_flops()
        self.names = [data_lib.source_name(src, i) for i, src in enumerate(cfg.data.sources)]
        self.packed: list[float] = []
        self.latest: dict = {}
        self.t_last = time.perf_counter()

    def due(self, done: int) -> bool:
        return done % self.cfg.log_every == 0 or done == self.cfg.steps

    def log(self, m: dict, done: int, batches, bar, fault: Fault) -> dict:
        """The metrics of step `done` (`m`, the step's outputs), logged; the faults of `during_metrics` and
        `during_log` at their places."""
        # replicated scalars: every process reads its own copy (multi-process arrays are not fully addressable,
        # so no device_get of the global array)
        fetched = {k: np.asarray(v.addressable_data(0)) for k, v in m.items()}
        fault("during_metrics", done)
        by_source = {k: fetched.pop(k) for k in ("source_loss", "source_tokens_trained") if k in fetched}
        metrics = {k: float(v) for k, v in fetched.items()}
        for name, loss_, n in zip(self.names, *by_source.values()):  # each source's loss beside its share
            if n > 0:  # a step without the source's tokens logs nothing for it
                metrics[f"data/loss/{name}"], metrics[f"data/tokens_trained/{name}"] = float(loss_), float(n)
        metrics["packing_efficiency"], self.packed = sum(self.packed) / max(len(self.packed), 1), []
        metrics["seq_len"], metrics["stage"] = self.cfg.seq_len, self.cfg.stage
        fed = getattr(batches, "source_tokens", list)()  # since the stage began, over resumes
        fed = [*fed, *[0] * (len(self.names) - len(fed))]
        for name, n in zip(self.names, fed):  # the realised share of the tokens this process's streams fed
            metrics[f"data/share/{name}"] = n / max(sum(fed), 1)
        now = time.perf_counter()
        metrics["step_time_s"] = (now - self.t_last) / min(self.cfg.log_every, done - self.start)
        metrics["tokens_per_s"] = self.tokens_per_step / metrics["step_time_s"]
        if self.peak:
            metrics["mfu"] = metrics["tokens_per_s"] * self.flops / (self.peak * self.mesh.size)
        metrics.update({f"device_memory/{k}": v for k, v in device_memory().items()})
        for i, (k, v) in enumerate(metrics.items()):
            if self.writer is not None:
                self.writer.add_scalar(k, v, done)
            if i == 0:
                fault("during_log", done)
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{metrics['tokens_per_s']:.0f}",
                        packed=f"{metrics['packing_efficiency']:.2f}")
        self.t_last, self.latest = now, metrics
        return metrics


def _run_hooks(hooks: Sequence[Hook], done: int, params: dict, log: MetricsLog, b: Begun, bar) -> str | None:
    """The hooks due after step `done`; a hook that ends the run makes the others due too. Returns its reason."""
    due = [h for h in hooks if h.due(done, b.cfg.steps)]
    if not due:
        return None
    main = jax.process_index() == 0
    ctx = StepContext(done, params, log.latest, b.cfg, b.mesh, log.writer, bar.write if main else (lambda line: None),
                      b.run)
    for hook in due:
        hook.fn(ctx)
    if ctx.stop_reason is not None:  # this step is the last: the hooks due after the last run too
        for hook in [h for h in hooks if all(h is not d for d in due)]:
            hook.fn(ctx)
    return ctx.stop_reason


def _stop_signal(done: int, signals, bar) -> bool:
    """Whether the run stops before step `done + 1`: several processes stop together, after the step where any of
    them received SIGTERM/SIGINT (every process then holds the agreed signal)."""
    several = jax.process_count() > 1
    stop = liveness.agree_stop(done, signals.received) if several else \
        ((0, signals.received) if signals.received is not None else None)
    if stop is None:
        return False
    own, signals.received = signals.received, stop[1]
    if own is None and jax.process_index() == 0:  # on its own line, not on the progress bar's
        bar.write(f"process {stop[0]} received {signal.Signals(stop[1]).name}: every process stops after step "
                  f"{done}, then saves it")
    return True


class _Profile:
    """`--profile`: a trace of `profile_steps` steps, from the second step of the run (the first allocates)."""

    def __init__(self, on: bool, start: int, cfg: Config, run_dir, bar):
        self.on, self.first, self.cfg, self.run_dir, self.bar, self.tracing = on, start + 2, cfg, run_dir, bar, False

    def before(self, step: int) -> None:
        if self.on and step == self.first:
            jax.profiler.start_trace(str(self.run_dir))
            self.tracing = True

    def after(self, step: int, m) -> None:
        if self.tracing and step == self.first - 1 + self.cfg.profile_steps:
            jax.block_until_ready(m)
            self.stop()
            if jax.process_index() == 0:  # on its own line, not on the progress bar's
                self.bar.write(f"profile of {self.cfg.profile_steps} steps written under {self.run_dir}/plugins/profile")

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False


@dataclasses.dataclass
class _Stepper:
    """What the steps run with (the arguments of `train`, the metrics log, the progress bar and the profile)."""

    b: Begun
    ckpt: Checkpointer
    hooks: Sequence[Hook]
    signals: Signals
    fault: Fault
    log: MetricsLog
    bar: object
    prof: _Profile


def train(b: Begun, ckpt: Checkpointer, state: dict, hooks: Sequence[Hook], signals: Signals, fault: Fault,
          profile: bool) -> dict:
    """Steps `b.start + 1` .. `cfg.steps` from `state` (the train state after step `b.start`); returns the run's
    result (`jaxlong.training.loop.run`).

    Raises:
      CheckpointError: a save failed (its line names the latest committed checkpoint).
      Preempted: after a signal, once the last finished step is saved.
    """
    cfg, mesh, run_dir = b.cfg, b.mesh, b.run.run_dir
    sharded = describe_param_sharding(mesh, state["params"])
    replicated = [line for line in sharded if "replicated" in line]
    say(f"FSDP: {len(sharded) - len(replicated)} of {len(sharded)} parameter leaves sharded over fsdp x ring x context"
        + (f"; replicated: {', '.join(r.split()[0] for r in replicated)}" if replicated else ""))
    main = jax.process_index() == 0
    log = MetricsLog(cfg, mesh, run_dir, b.start, main)
    bar = tqdm(total=cfg.steps, initial=b.start, desc="train", unit="step", dynamic_ncols=True, disable=not main)
    r = _Stepper(b, ckpt, hooks, signals, fault, log, bar, _Profile(profile, b.start, cfg, run_dir, bar))
    if liveness.watchdog() is not None:  # a lost process's line names the latest checkpoint
        liveness.watchdog().checkpoints = lambda: latest_checkpoint_text(ckpt.directory)
    try:
        done, latest, stopped = _steps(r, state)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; latest committed checkpoint: step {Checkpointer.latest_in(ckpt.directory)}") from e
    finally:
        signals.deferred = False
        r.prof.stop()
        bar.close()
        if log.writer is not None:
            log.writer.close()
    if signals.received is not None:
        name = signal.Signals(signals.received).name
        say(f"stopped by {name} after step {done}; latest committed checkpoint: step {latest}; continue with --resume")
        raise Preempted(signals.received, f"stopped by {name} after step {done}")
    ended = f"done: step {cfg.steps}" if stopped is None else f"stopped after step {done} by a hook ({stopped})"
    say(f"{ended}, loss {log.latest.get('loss', float('nan')):.4f}; "
        f"TensorBoard: tensorboard --logdir {cfg.run_dir}; checkpoints in {ckpt.directory}")
    return {"metrics": log.latest, "run_dir": str(run_dir), "step": done, "stopped": stopped}


def _steps(r: _Stepper, state: dict) -> tuple[int, int | None, str | None]:
    """The loop of `train`: returns `(the last step done, the latest committed checkpoint, a hook's stop reason)`.

    `done` is the step counter of the bound `state` (`int(state['step'])`): a signal cannot interrupt between the two
    assignments that bind them, since the handler only records it. `data_state` is the input pipeline's state after
    the batch of step `done`: saved with that state."""
    b, fault, log, batches = r.b, r.fault, r.log, r.b.batches
    cfg, several = b.cfg, jax.process_count() > 1
    done, started, data_state, stopped = b.start, None, batches.get_state(), None
    while done < cfg.steps:
        if _stop_signal(done, r.signals, r.bar):
            break
        step = done + 1
        fault("before_batch", step)
        r.prof.before(step)
        # an on-policy source (RL's rollouts) samples from the parameters this step starts from
        host_batch = batches.next_for(state["params"]) if getattr(batches, "on_policy", False) else next(batches)
        host_batch.pop(data_lib.PAIR_FEATURE, None)  # preference pairs: which pair (the reference pass's)
        log.packed.append(data_lib.packing_efficiency(host_batch))
        if log.names:  # a mixture: the source of every token, for each source's loss (0: no source)
            host_batch.setdefault(data_lib.SOURCE_FEATURE, np.zeros_like(host_batch["inputs"]))
        fault("before_put", step)
        batch = put_batch(host_batch, b.mesh, batches.rows, cfg.global_batch)
        fault("before_dispatch", step)
        if r.signals.received is not None and not several:  # several processes stop where they agree
            break
        new_state, m = b.compiled(state, batch)  # donates `state`
        fault("after_step", step)
        state, done, data_state = new_state, step, batches.get_state()
        fault("after_bind", step)
        r.prof.after(step, m)
        if log.due(done):
            fault("before_metrics", step)
            log.log(m, done, batches, r.bar, fault)
        stopped = _run_hooks(r.hooks, done, state["params"], log, b, r.bar)
        r.bar.update(1)
        fault("before_save", step)
        if r.ckpt.should_save(done):
            started = r.ckpt.save(state, to_dict(cfg), data_state=all_streams(batches, data_state)) or started
            if log.writer is not None:  # the logs of the steps a checkpoint holds survive a SIGKILL with it
                log.writer.flush()
            fault("during_save", step)  # the asynchronous commit may still be running
        fault("end_of_step", step)
        if stopped is not None:  # a hook ended the run after this step (saved below)
            break
    fault("after_loop", done)
    return done, _final_save(r, state, data_state, done, started), stopped


def _final_save(r: _Stepper, state: dict, data_state: dict, done: int, started: int | None) -> int | None:
    """The last finished step saved (interrupted between saves, or a final step the policy skipped) and every save
    committed; returns the latest committed checkpoint. A failure while stopping on a signal is reported, the steps
    it loses named."""
    try:
        if done > r.b.start and started != done:
            data = all_streams(r.b.batches, data_state)
            started = r.ckpt.save(state, to_dict(r.b.cfg), force=True, data_state=data) or started
            r.fault("during_final_save", done)
        latest = r.ckpt.wait()
        r.fault("after_commit", done)
    except CheckpointError as e:
        if r.signals.received is None:
            raise
        latest = Checkpointer.latest_in(r.ckpt.directory)
        if jax.process_index() == 0:
            r.bar.write(f"{e}; steps {(latest or 0) + 1}..{done} are lost")
    return latest

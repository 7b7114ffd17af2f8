"""Hooks of the train loop: work that runs between steps, every N steps and after the last, outside the step.

The train loop (`jaxlong.training.loop`) owns what must happen at an exact point of a step: binding the new
state, the metrics, the checkpoint with its data state, the stop on SIGTERM/SIGINT. Everything else that looks
at the model between steps is a hook (as Levanter's `Trainer.add_hook(fn, every=N)`), which the command adds:
validation on held-out documents and RULER (`jaxlong.evaluation.validation.validation_hooks`, added by `python -m
jaxlong.train` through `jaxlong.recipes`), or a user's own probe passed to `jaxlong.training.loop.run(cfg,
hooks=[Hook(fn, every=100)])`. A hook's `start` may check its options, prepare its data and compile its own
programs. A hook runs on every process of a multi-process run (it may run collectives on the mesh).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import jax

__all__ = ["Hook", "RunContext", "StepContext"]


@dataclasses.dataclass
class RunContext:
    """What the trainer knows once a run starts, given to each hook's `start` (before anything compiles) and to
    its `fn` after each step it is due (`StepContext.run`).

    Attributes:
      cfg: the run's validated config.
      mesh: its mesh.
      run_dir: `RUN_DIR`.
      tokenizer: the run's tokenizer (`jaxlong.data.run_tokenizer`).
      source: the documents of `data.path` (or the first of `data.sources`), or None (batches of one's own and no
        validation).
      held_out: the indices of `source`'s documents held out of training for validation (`eval_every` > 0).
      validation_batches: the host batches of those documents (`jaxlong.data.heldout.validation_split`); with an
        objective whose batches need its preparation (DPO's reference) they are made again after it.
      objective: the run's `jaxlong.objectives.base.Objective`.
      say: prints a line on process 0 (above the progress bar once it shows).
    """

    cfg: Any
    mesh: jax.sharding.Mesh
    run_dir: Path
    tokenizer: Any
    source: Any
    held_out: list[int]
    validation_batches: list[dict]
    objective: Any
    say: Callable[[str], None]


@dataclasses.dataclass
class StepContext:
    """What a hook sees after step `step` (1-based, global): `params` (the FSDP-sharded parameters of that step;
    read them, do not keep them past the hook: the next step donates the state), `metrics` (the latest logged
    scalars, `loss`, `lr`, ...), `cfg`, `mesh`, `writer` (the run's TensorBoard `SummaryWriter` on process 0,
    else None), `say` (print a line above the progress bar, on process 0) and `run` (the `RunContext`);
    `request_stop` ends the run."""

    step: int
    params: dict
    metrics: dict
    cfg: Any
    mesh: jax.sharding.Mesh
    writer: Any
    say: Callable[[str], None]
    run: RunContext | None = None
    stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """End the run after this step, before `steps` (early stopping, a budget spent): the loop saves this
        step's checkpoint and `run` returns normally, its result's `stopped` = `reason`. In a multi-process run
        every process must request it at the same step (a hook runs on every process)."""
        self.stop_reason = reason


@dataclasses.dataclass
class Hook:
    """`fn(context)` after every step divisible by `every` and after the run's last step (`every` >= 1); `start(run)`,
    when given, once when the run starts, before anything compiles (`RunContext`).

    Raises:
      ValueError: `every` is not an integer >= 1.
    """

    fn: Callable[[StepContext], None]
    every: int = 1
    name: str = ""
    start: Callable[[RunContext], None] | None = None

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Hook({self.name or self.fn}): every={self.every!r}; give a step count >= 1")

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last

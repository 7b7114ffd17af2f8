"""Hooks of the train loop: work that runs between steps, every N steps and after the last, outside the step.

The train loop (`jaxlong.training.loop`) owns what must happen at an exact point of a step: binding the new
state, the metrics, the checkpoint with its data state, the stop on SIGTERM/SIGINT. Everything else that looks
at the model between steps is a hook (as Levanter's `Trainer.add_hook(fn, every=N)`): validation on held-out
documents and RULER (`validation_hook`), or a user's own probe passed to `jaxlong.training.loop.run(cfg,
hooks=[Hook(fn, every=100)])`. A hook runs on every process of a multi-process run (it may run collectives on
the mesh); `StepContext.say` prints on process 0 only and `writer` is None on the other processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from jaxlong.config import Config
from jaxlong.evaluation import Validator, ruler

__all__ = ["Hook", "StepContext", "validation_hook"]


@dataclasses.dataclass
class StepContext:
    """What a hook sees after step `step` (1-based, global): `params` (the FSDP-sharded parameters of that step;
    read them, do not keep them past the hook: the next step donates the state), `metrics` (the latest logged
    scalars, `loss`, `lr`, ...), `cfg`, `mesh`, `writer` (the run's TensorBoard `SummaryWriter` on process 0,
    else None) and `say` (print a line above the progress bar, on process 0); `request_stop` ends the run."""

    step: int
    params: dict
    metrics: dict
    cfg: Config
    mesh: jax.sharding.Mesh
    writer: Any
    say: Callable[[str], None]
    stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """End the run after this step, before `steps` (early stopping, a budget spent): the loop saves this
        step's checkpoint and `run` returns normally, its result's `stopped` = `reason`. In a multi-process run
        every process must request it at the same step (a hook runs on every process)."""
        self.stop_reason = reason


@dataclasses.dataclass
class Hook:
    """`fn(context)` after every step divisible by `every` and after the run's last step (`every` >= 1)."""

    fn: Callable[[StepContext], None]
    every: int = 1
    name: str = ""

    def __post_init__(self):
        if not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"Hook({self.name or self.fn}): every={self.every!r}; give a step count >= 1")

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last


def validation_hook(validator: Validator, suite: ruler.RulerValidator | None = None) -> Hook:
    """Validation every `eval_every` steps (and after the last): the held-out loss (`eval/loss`,
    `eval/perplexity`; with `objective: dpo` the held-out pairs' `eval/dpo/loss` and `eval/dpo/rewards/...`) of
    `validator`, then, with `suite` (`ruler_tasks`), RULER's scores
    (`eval/ruler_<scoring>/...`)."""

    def validate(ctx: StepContext) -> None:
        ev = validator.run(ctx.params)
        if ctx.writer is not None:
            prefix = "eval/dpo/" if "pairs" in ev else "eval/"  # a DPO stage's loss is not a next-token loss
            for k, v in ev.items():
                if k not in ("tokens", "pairs"):
                    ctx.writer.add_scalar(prefix + k, v, ctx.step)
        if "pairs" in ev:  # preference pairs (objective: dpo)
            ctx.say(f"step {ctx.step}: eval loss {ev['loss']:.4f} (reward accuracy {ev['rewards/accuracies']:.3f}, "
                    f"margin {ev['rewards/margins']:.3f}, {ev['pairs']:.0f} held-out pairs)")
        else:
            ctx.say(f"step {ctx.step}: eval loss {ev['loss']:.4f} (perplexity {ev['perplexity']:.2f}, "
                    f"{ev['tokens']:.0f} held-out tokens)")
        if suite is not None:
            rows = suite.run(ctx.params)
            if ctx.writer is not None:
                ruler.log_scalars(ctx.writer, rows, ctx.step, ruler.tag_prefix(suite.scoring))
            ctx.say(f"step {ctx.step}: ruler ({suite.scoring}) " + ", ".join(
                f"{r['task']}@{r['length']} {r['correct']:.3g}/{r['cases']}" for r in rows))

    return Hook(validate, every=validator.cfg.eval_every, name="validation")

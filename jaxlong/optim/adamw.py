"""The optimizer section of the config (`optim.*`) and the optimizer it builds: optax AdamW behind global-norm
clipping, with a linear warmup then a cosine decay (Loshchilov & Hutter, arXiv 1711.05101)."""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import optax

from jaxlong.core.errors import ConfigError

__all__ = ["OptimConfig", "validate_optim", "schedule_length", "make_optimizer"]


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm gradient clipping (optax)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    decay_steps: int = 0  # length of the warmup + cosine schedule; 0 means `steps` (see `schedule_length`)
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float | None = 1.0  # global-norm gradient clipping; null disables it
    # The global step at which this schedule's warmup starts (a recipe's stage, `jaxlong.recipes.recipe`): the
    # learning rate at step s is the schedule's at s - schedule_start, over `steps - schedule_start` steps.
    schedule_start: int = 0
    # Start AdamW afresh (moments zero, bias correction from 1) at a recipe stage's first step, or where a resumed
    # checkpoint's config did not ask for it (`--resume-with-changes optim.reset_state=true`), instead of carrying
    # the checkpoint's optimizer state; the parameters and the schedule's global step carry on.
    reset_state: bool = False


def schedule_length(steps: int, warmup_steps: int, decay_steps: int) -> int:
    """Steps of the warmup + cosine-decay learning-rate schedule (optax's `decay_steps`, warmup included):
    `optim.decay_steps`, or `steps` when it is 0, and at least `warmup_steps + 1` (the cosine needs a step after
    the warmup). Two configs with the same length, warmup and rates have the same schedule: a 4-step run with
    `optim.warmup_steps=5` has a 6-step schedule, as has the same run extended to `steps=6`."""
    return max(decay_steps or steps, warmup_steps + 1)


def validate_optim(o: OptimConfig) -> None:
    """AdamW, warmup and cosine-decay ranges.

    Raises:
      ConfigError: lr <= 0; clip_norm <= 0 (use null to disable clipping); warmup_steps < 0; decay_steps < 0
        or (when set) < warmup_steps; min_lr_ratio outside [0, 1]; weight_decay < 0; b1 or b2 outside [0, 1);
        eps <= 0.
    """
    if not o.lr > 0:
        raise ConfigError(f"optim.lr={o.lr} must be positive, e.g. 3e-4")
    if o.clip_norm is not None and not o.clip_norm > 0:
        raise ConfigError(
            f"optim.clip_norm={o.clip_norm} must be a positive global gradient norm (e.g. 1.0), or null to disable clipping"
        )
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0 (0: no warmup)")
    if o.decay_steps < 0 or (o.decay_steps and o.decay_steps < o.warmup_steps):
        raise ConfigError(
            f"optim.decay_steps={o.decay_steps} must be >= optim.warmup_steps={o.warmup_steps} "
            f"(it counts the warmup), or 0 for `steps`"
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1] (final lr / peak lr)")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    for key in ("b1", "b2"):
        if not 0.0 <= getattr(o, key) < 1.0:
            raise ConfigError(f"optim.{key}={getattr(o, key)} must be in [0, 1), e.g. 0.9 / 0.95")
    if not o.eps > 0:
        raise ConfigError(f"optim.eps={o.eps} must be positive, e.g. 1e-8")


def make_optimizer(o: OptimConfig, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax AdamW behind global-norm clipping, with linear warmup then cosine decay to `lr * min_lr_ratio`, from
    global step `optim.schedule_start` (0; a recipe's stage starts its own) to `steps` (the run's last step).

    Returns:
      `(optax transformation, learning-rate schedule of the step)`."""
    stage_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.lr,
        warmup_steps=o.warmup_steps,
        decay_steps=schedule_length(steps - o.schedule_start, o.warmup_steps, o.decay_steps),
        end_value=o.lr * o.min_lr_ratio,
    )

    def schedule(count):  # from `schedule_start` (a recipe's stage: its own warmup and decay from its first step)
        return stage_schedule(jnp.maximum(count - o.schedule_start, 0))

    tx = optax.chain(
        optax.clip_by_global_norm(o.clip_norm) if o.clip_norm is not None else optax.identity(),
        optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay),
    )
    return tx, schedule

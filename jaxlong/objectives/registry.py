"""The objectives a config names (`objective: lm | dpo | grpo`): the one place that maps the name to its `Objective`.

A new objective is a module of `jaxlong.objectives` with a `name`, a `from_config(cfg)` and a `check(data)`, and one
entry in `OBJECTIVES` (docs/training.md#the-trainer-as-a-library).
"""

from __future__ import annotations

from typing import Literal

from jaxlong.core.errors import check_choice
from jaxlong.objectives.base import Objective
from jaxlong.objectives.dpo import PreferenceLoss, PreferenceOptimization
from jaxlong.objectives.grpo import GroupRelativePolicyOptimization
from jaxlong.objectives.lm import LanguageModeling

__all__ = ["OBJECTIVES", "ObjectiveName", "objective_for", "check_objective"]

ObjectiveName = Literal["lm", "dpo", "grpo"]  # the config's `objective`
OBJECTIVES: dict[str, type[Objective]] = {c.name: c for c in (LanguageModeling, PreferenceOptimization,
                                                              GroupRelativePolicyOptimization)}


def objective_for(cfg) -> Objective:
    """The `Objective` the run's config names (`objective`), built from the sections it reads."""
    return OBJECTIVES[cfg.objective].from_config(cfg)


def check_objective(cfg) -> None:
    """`objective` names an objective, `dpo.loss` a preference loss, and the objective's own rules hold for the data
    (`Objective.check`: e.g. preference pairs for `dpo` and only for it) and for the rest of the run
    (`Objective.check_run`: e.g. GRPO's groups fit `seq_len`).

    Raises:
      ConfigError: naming the option, its value and what would work.
    """
    check_choice("objective", cfg.objective, ObjectiveName)
    check_choice("dpo.loss", cfg.dpo.loss, PreferenceLoss)
    objective = objective_for(cfg)
    objective.check(cfg.data)
    objective.check_run(cfg)

"""Runs as `python -m jaxlong.train` runs them: one config with its validation hooks (`train`), or a recipe's
stages in order in one run directory, each with its gate (`jaxlong.recipes.recipe`, `jaxlong.recipes.gates`;
docs/recipes.md). The trainer underneath (`jaxlong.training`) knows neither evaluation nor recipes."""

from jaxlong.recipes.recipe import Stage, check_sources, expand, run_recipe, stage_of_step, train

__all__ = ["Stage", "check_sources", "expand", "run_recipe", "stage_of_step", "train"]

"""A plan per stage of a recipe: `python -m jaxlong.memory --fit --config RECIPE.yaml [--target h100]
[--write-recipe PLANNED.yaml] [--out DIR]`.

Each stage of the recipe (`jaxlong.recipes.recipe.expand`: the base config, the stage's keys, the command line's
overrides) is searched as `python -m jaxlong.memory --fit` searches one config (`jaxlong.plan.fit`: the fastest
attention / remat / tiling / mesh split within the device and host budgets): its table and verdict, then a table of
the stages (winner, device and host memory, estimated tokens/s per GPU) and the recipe's estimated wall-clock
time, each stage's tokens (`steps x global_batch x seq_len`) over its estimated tokens/s over the mesh's devices.
With a GPU target and no GPU these are XLA GPU compiles and roofline estimates, not measurements.

`--write-recipe FILE` writes the recipe with each stage's winner merged into the stage's keys (every key the
search sets, nested, replacing the stage's own settings of them; YAML comments are not kept) and prints the
command that trains it (`python -m jaxlong.train --config FILE` and the command line's overrides the plan does
not set). `--out DIR` keeps each stage's search as JSON (`fit_<model>_<target>_<seq_len>.json`, `..._dpo.json` for a
DPO stage).
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

from jaxlong.config import Config, ConfigError, load_config
from jaxlong.core.errors import fail
from jaxlong.core.units import fmt_gib
from jaxlong.plan import fit_report as fit_cli
from jaxlong.plan.fit import parse_setting
from jaxlong.plan.target import parse_target
from jaxlong.recipes import expand

__all__ = ["main", "stage_seconds", "write_recipe"]


def stage_seconds(cfg: Config, steps: int, tokens_per_s_per_gpu: float) -> float:
    """Estimated wall-clock seconds of `steps` steps of `cfg` (`global_batch` x `seq_len` tokens each) at
    `tokens_per_s_per_gpu` on each of `mesh.num_devices` devices (checkpoints and evaluation not counted)."""
    return steps * cfg.global_batch * cfg.seq_len / (tokens_per_s_per_gpu * cfg.mesh.num_devices)


def _hours(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 60 else f"{seconds:.2g} s"


def main(args, argv_overrides: list[str]) -> int:
    """`python -m jaxlong.memory --fit`: a config without `stages` is planned as one (`jaxlong.plan.fit_report.main`); a
    recipe has every stage planned: each stage's search, the stages' table and the estimated total time;
    `--write-recipe` and `--out` written.

    Returns: 0 when every stage has a winner, 1 when one has none (the table names it), 2 on bad input.
    """
    try:
        cfg = load_config(args.config, argv_overrides)
        if not cfg.stages:
            if args.write_recipe:
                raise ConfigError(f"--write-recipe {args.write_recipe}: the config has no stages; it writes a "
                                  f"recipe's stages with their winners (for one config, the train command printed "
                                  f"with the search is the plan)")
            return fit_cli.main(args, argv_overrides)
        if args.out and args.out.endswith(".json"):
            raise ConfigError(f"--out {args.out}: a recipe's plan writes one JSON per stage; give a directory")
        devices = [f"mesh.num_devices={parse_target(args.target).devices}"] if args.target else []
        stages = expand(cfg, [*argv_overrides, *devices])
        counts = {s.cfg.mesh.num_devices for s in stages}
        if len(counts) > 1:
            raise ConfigError(f"the stages use different mesh.num_devices ({sorted(counts)}); plan them one at a time")
        plans = []
        for s in stages:
            scfg = copy.deepcopy(s.cfg)
            plans.append((s, scfg, copy.deepcopy(scfg), *fit_cli.resolve(args, scfg)))
        fit_cli.prepare_jax(plans[0][1], plans[0][3])
    except (ConfigError, ValueError) as e:
        return fail(e)
    results = []
    for s, scfg, base, target, budget, host_budget, collectives in plans:
        print(f"\n== stage {s.index} ({s.name}): seq_len {scfg.seq_len:,}, steps {s.start + 1}-{s.end}", flush=True)
        try:
            res = fit_cli.run_cli(args, scfg, target, budget, host_budget, collectives, argv_overrides, base,
                                  show_command=False)
        except (ConfigError, ValueError) as e:
            return fail(f"stage {s.index} ({s.name}): {e}")
        results.append((s, scfg, base, res))
    print()
    print(format_plan(results, plans[0][3]))
    ok = all(res.winner for *_, res in results)
    if args.write_recipe and ok:
        write_recipe(Path(args.config), Path(args.write_recipe), results)
        print(f"wrote {args.write_recipe}: train it with {train_command(args.write_recipe, argv_overrides, results)}")
    elif args.write_recipe:
        print(f"not written: {args.write_recipe} (a stage has no setup that fits)")
    return 0 if ok else 1


def format_plan(results, target) -> str:
    """Markdown: per stage its length, steps, winner (its changes to the stage), device total, host per node,
    estimated tokens/s per GPU and time; then the recipe's estimated total."""
    where = f"{target.describe()}, XLA GPU compile without a GPU: estimates" if target is not None else "this machine"
    lines = [f"recipe plan ({where}):", "",
             "| stage | seq_len | steps | winner (changes to the stage) | GiB / device | host GiB / node | "
             "est. tokens/s/GPU | est. time |", "|---|---:|---:|---|---:|---:|---:|---:|"]
    total = 0.0
    for s, scfg, base, res in results:
        w = res.winner
        if w is None:
            lines.append(f"| {s.index} ({s.name}) | {scfg.seq_len:,} | {s.end - s.start} | nothing fits | | | | |")
            continue
        changes = " ".join(fit_cli.winner_overrides(res, base)) or "(the stage's own setup)"
        tps = w["tokens_per_s_per_gpu"]  # None when the cost model gives no estimate
        secs = stage_seconds(scfg, s.end - s.start, tps) if tps else None
        total += secs or 0.0
        speed = f"{tps:,.0f} | {_hours(secs)}" if tps else "n/a | n/a"
        lines.append(f"| {s.index} ({s.name}) | {scfg.seq_len:,} | {s.end - s.start} | `{changes}` | "
                     f"{fmt_gib(w['total'], 1)} | {fmt_gib(w['host_per_node'], 1)} | {speed} |")
    lines.append("")
    lines.append(f"estimated time of the recipe's training steps: {_hours(total)} (checkpoints, gates and "
                 f"compiles not counted)")
    return "\n".join(lines)


def train_command(path: str, argv_overrides: list[str], results) -> str:
    """`python -m jaxlong.train --config PATH` and the command line's overrides, less those of a key a stage's
    winner sets (command-line overrides win over a stage's keys, so they would undo the plan)."""
    planned = {text.split("=", 1)[0] for *_, res in results for text in res.winner["overrides"].split()}
    keep = [o for o in argv_overrides if o.split("=", 1)[0].strip() not in planned]
    return " ".join(["python -m jaxlong.train", "--config", str(path), *keep])


def write_recipe(source: Path, out: Path, results) -> None:
    """Write the recipe `source` to `out` with each stage's winner (every key the search sets: mesh split,
    attention, remat, tiling) merged into the stage's mapping as nested keys; a stage's own setting of the same
    key (nested or dotted) is replaced. YAML comments are not kept."""
    raw = yaml.safe_load(source.read_text())
    for s, _, base, res in results:
        stage = raw["stages"][s.index]
        for text in res.winner["overrides"].split():
            path, value = parse_setting(text)
            key = ".".join(path)
            for i in range(1, len(path)):  # a dotted setting of this key or of a section above it
                dotted = ".".join(path[:i])
                if isinstance(stage.get(dotted), dict):
                    _merge(stage, path[:i], stage.pop(dotted))
            stage.pop(key, None)
            _merge(stage, path[:-1], {path[-1]: value})
    header = (f"# {source} with each stage's memory setup from python -m jaxlong.memory --fit (XLA compiles; with a GPU "
              f"target and no GPU, estimates)\n")
    out.write_text(header + yaml.safe_dump(raw, sort_keys=False, width=120))


def _merge(stage: dict, path: list[str], values: dict) -> None:
    node = stage
    for part in path:
        node = node.setdefault(part, {})
    node.update(values)

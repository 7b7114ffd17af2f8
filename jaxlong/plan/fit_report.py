"""Reports and flags of the fit (`jaxlong.plan.fit`), shared by `python -m jaxlong.memory --fit` and
`python -m jaxlong.train --fit` (flags in `add_arguments`).

    python -m jaxlong.memory --fit --target h100 --config configs/llama3_1_8b.yaml seq_len=131072 --out fit.json

Prints a table of the compiled candidates, the candidates not compiled grouped by reason, the verdict (the
winner, or the closest candidate with its peak when nothing fits) and the winner as a `python -m jaxlong.train`
command line of its changes to the loaded config; `--out` writes the same as JSON.
"""

from __future__ import annotations

import copy
import functools
import json
import os

from jaxlong.config import Config, ConfigError, load_config, validate
from jaxlong.core import distributed, xla_log
from jaxlong.core.errors import fail
from jaxlong.core.mesh import resolve_mesh_shape
from jaxlong.core.units import fmt_gib
from jaxlong.plan import planner
from jaxlong.plan.fit import (
    COST_MODELS,
    FitError,
    FitOptions,
    FitResult,
    analytic_cost,
    configure,
    fit,
    parse_setting,
    strip_implied,
    with_estimate,
)
from jaxlong.plan.target import cuda_plugin_available, parse_target


def _short(key: str) -> str:
    """For tables: also without the device count, `mesh.data` and a ring of 1."""
    return " ".join(o for o in strip_implied(key).split()
                    if not o.startswith(("mesh.num_devices=", "mesh.data=")) and o != "mesh.ring=1")


def format_report(res: FitResult, budget: int, host_budget: int | None, *, per_reason: int = 6) -> str:
    """Markdown: the compiled candidates (GiB per device, host GiB per node), the candidates not compiled grouped
    by reason (at most `per_reason` named per group; all are in the JSON), the verdict."""
    lines = ["| # | overrides | peak (compiled) | total | host / node | est. tokens/s/GPU | recompute | fits |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in res.rows:
        mark = " (cached)" if r["cached"] else ""
        win = " **winner**" if res.winner is r else ""
        lines.append(f"| {r['index']}{mark} | {_short(r['overrides'])} | {fmt_gib(r['peak'], 1)} | {fmt_gib(r['total'], 1)} | "
                     f"{fmt_gib(r['host_per_node'], 1)} | {r['tokens_per_s_per_gpu']:,.0f} | {r['recompute_factor']:.2f} | "
                     f"{'yes' if r['fits'] else 'no'}{win} |")
    invalid = sum(p["reason"].startswith("invalid") for p in res.pruned)
    lines.append(f"\n{res.compiles} compile{'s' * (res.compiles != 1)} for {res.candidates} valid candidates "
                 f"({invalid} invalid); {len(res.pruned) - invalid} settled without a compile:")
    groups: dict[str, list[str]] = {}
    for p in res.pruned:
        groups.setdefault(p["reason"], []).append(_short(p["overrides"]))
    for reason, keys in groups.items():
        more = f" ... and {len(keys) - per_reason} more" if len(keys) > per_reason else ""
        lines.append(f"- {reason} ({len(keys)}): " + "; ".join(keys[:per_reason]) + more)
    lines.append("")
    if res.winner is not None:
        w = res.winner
        lines.append(f"winner: #{w['index']} {_short(w['overrides'])} -- total {fmt_gib(w['total'], 1)} of {fmt_gib(budget, 1)} GiB, "
                     f"host {fmt_gib(w['host_per_node'], 1)} GiB per node, {w['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU "
                     f"(estimated)")
    elif res.closest is not None:
        c = res.closest
        host = f", host {fmt_gib(c['host_per_node'], 1)} of {fmt_gib(host_budget, 1)} GiB per node" if host_budget else ""
        lines.append(f"nothing fits: the closest candidate is #{c['index']} [{strip_implied(c['overrides'])}] with peak "
                     f"{fmt_gib(c['peak'], 1)} GiB, total {fmt_gib(c['total'], 1)} GiB against the budget of {fmt_gib(budget, 1)} GiB{host}")
    else:
        lines.append("nothing fits: no candidate was compiled (raise --max-compiles)")
    return "\n".join(lines)


def winner_overrides(res: FitResult, base: Config) -> list[str]:
    """The winner's overrides that change `base` (the config as loaded, before the search), in search order."""
    if res.winner is None:
        return []
    out = []
    for text in res.winner["overrides"].split():
        path, value = parse_setting(text)
        if functools.reduce(getattr, path, base) != value:
            out.append(text)
    return out


def train_command(config_path: str | None, user_overrides: list[str], res: FitResult, base: Config) -> str:
    """`python -m jaxlong.train --config FILE k=v ...`: the user's overrides the winner does not set, then the
    winner's changes to `base`."""
    win = winner_overrides(res, base)
    keys = {o.split("=", 1)[0] for o in win}
    keep = [o for o in user_overrides if o.split("=", 1)[0].strip() not in keys]
    parts = ["python -m jaxlong.train"] + ([f"--config {config_path}"] if config_path else []) + keep + win
    return " ".join(parts)


def to_json(res: FitResult, *, cfg: Config, target, budget, host_budget, command: str | None) -> dict:
    return {"model": cfg.model.name, "seq_len": cfg.seq_len, "global_batch": cfg.global_batch,
            "target": target.describe() if target is not None else None, "budget": budget, "host_budget": host_budget,
            "compiles": res.compiles, "candidates": res.candidates, "compiled": res.rows, "pruned": res.pruned,
            "winner": res.winner, "closest": res.closest, "command": command}


# ----------------------------------------------------------------------------------------------
# Command line (`python -m jaxlong.memory --fit`, `python -m jaxlong.train --fit`).


def add_arguments(parser, *, planner_options: bool) -> None:
    """The `--fit` flags; `planner_options` also adds `--target`, `--budget`, `--host-budget`, `--headroom`, `--out`
    (which `jaxlong.memory` already has)."""
    parser.add_argument("--fit", action="store_true",
                        help="search the fastest attention / remat / tiling / mesh split that fits the budget")
    parser.add_argument("--max-compiles", type=int, default=12, help="--fit: compile budget (default 12)")
    parser.add_argument("--cost-model", default="estimate", choices=sorted(COST_MODELS),
                        help="--fit: rank by the compiled program's step-time estimate, or a closed-form FLOP count")
    if planner_options:
        parser.add_argument("--target", default=None, help="--fit: plan for a GPU without one, e.g. h100:8x2")
        parser.add_argument("--budget", default=None, help="--fit: device memory budget (default: the target's)")
        parser.add_argument("--host-budget", default=planner.HOST_BUDGET,
                            help=f"--fit: host memory per node (default {planner.HOST_BUDGET}: what a 2 TB node can pin)")
        parser.add_argument("--headroom", default="2%", help="--fit: fragmentation headroom")
        parser.add_argument("--out", default=None, help="--fit: JSON file (or directory) for the result")
    else:
        parser.add_argument("--write-recipe", default=None,
                            help="--fit on a recipe: write it, each stage with its winner, to this YAML file")


def resolve(args, cfg: Config):
    """(target, budget, host_budget, collective buffers) from the flags; sets `mesh.num_devices` from the target.

    Raises:
      ConfigError / ValueError: a bad flag, named.
    """
    if args.max_compiles < 1:
        raise ConfigError(f"--max-compiles {args.max_compiles}: must be at least 1")
    with_estimate(planner.plan, COST_MODELS[args.cost_model])  # a cost model the planner cannot feed fails here
    target = None
    if args.target:
        target = parse_target(args.target)
        if not cuda_plugin_available():
            raise ConfigError(f"--target {args.target} needs the CUDA plugin: pip install 'jax[cuda12]'")
        cfg.mesh.num_devices = target.devices
    elif not distributed.gpu_driver_present() and getattr(COST_MODELS[args.cost_model], "needs_estimate", False):
        raise ConfigError("--fit: this machine has no NVIDIA GPU, and --fit ranks setups by a GPU compile's step-time "
                          "estimate; plan for one with --target h100 (or h200, a100): python -m jaxlong.memory --fit "
                          "--target h100 ... prints the overrides to train with there")
    try:  # the search re-splits the mesh; a split made for another device count only loses its first place
        resolve_mesh_shape(cfg.mesh, cfg.mesh.num_devices)
    except ConfigError:
        cfg.mesh.data = cfg.mesh.data if cfg.mesh.data > 0 and cfg.mesh.num_devices % cfg.mesh.data == 0 else 1
        cfg.mesh.fsdp, cfg.mesh.ring, cfg.mesh.context = -1, 1, 1
    budget, host_budget, collectives = planner.budgets(args.budget, args.host_budget,
                                                       getattr(args, "collective_buffers", None), target,
                                                       cfg.mesh.num_devices)
    return target, budget, host_budget, collectives


def prepare_jax(cfg: Config, target) -> None:
    """Environment before jax creates a backend: no CUDA initialization for a deviceless target, simulated CPU devices."""
    if target is not None and not distributed.gpu_driver_present():
        distributed.use_cpu_platform()
    distributed.set_host_device_count(cfg.mesh.num_devices)


def run_cli(args, cfg: Config, target, budget: int, host_budget: int, collectives, argv_overrides: list[str],
            base: Config, show_command: bool = True):
    """Run the search, print the table, the verdict and (with `show_command`) the train command (the winner's
    changes to `base`, the config as loaded), write `--out`. Returns the result.

    Raises:
      FitError: see `fit`.
    """
    where = target.describe() if target else f"{cfg.mesh.num_devices} devices"
    print(f"fit {cfg.model.name}: seq_len {cfg.seq_len:,}, global_batch {cfg.global_batch}, {where}, budget "
          f"{fmt_gib(budget, 1)} GiB per device, host {fmt_gib(host_budget, 1)} GiB per node, ranked by --cost-model {args.cost_model}",
          flush=True)
    cost = COST_MODELS[args.cost_model]
    if args.cost_model == "analytic" and target is not None and target.peak_flops:
        cost = functools.wraps(analytic_cost)(functools.partial(analytic_cost, peak_flops=target.peak_flops))
    with xla_log.collecting() as log:
        options = FitOptions(max_compiles=args.max_compiles, cost_model=cost, headroom=args.headroom,
                             collective_buffers=collectives)
        res = fit(cfg, target, budget=budget, host_budget=host_budget, options=options)
    source = next((r["source"] for r in res.rows), "")
    print(f"source: {source}")
    print(format_report(res, budget, host_budget))
    for line in log.summary():
        print(line)
    command = train_command(args.config, argv_overrides, res, base) if res.winner else None
    if command and show_command:
        print(f"\n{command}")
    if args.out:
        path = args.out
        if not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            tag = args.target.replace(":", "-") if args.target else "cpu"
            kind = "" if cfg.objective == Config().objective else f"_{cfg.objective}"  # a DPO stage apart from SFT
            path = os.path.join(path, f"fit_{cfg.model.name}_{tag}_{cfg.seq_len}{kind}.json")
        with open(path, "w") as f:
            json.dump(to_json(res, cfg=cfg, target=target, budget=budget, host_budget=host_budget, command=command),
                      f, indent=1, default=str)
        print(f"wrote {path}")
    return res


def main(args, argv_overrides: list[str]) -> int:
    """`python -m jaxlong.memory --fit ...`: 0 when something fits, 1 when nothing does, 2 on bad input."""
    try:
        cfg = load_config(args.config, argv_overrides)
        base = copy.deepcopy(cfg)
        target, budget, host_budget, collectives = resolve(args, cfg)
        prepare_jax(cfg, target)
        res = run_cli(args, cfg, target, budget, host_budget, collectives, argv_overrides, base)
    except (ConfigError, ValueError) as e:
        return fail(e)
    return 0 if res.winner else 1


def fit_for_training(args, cfg: Config, argv_overrides: list[str]) -> Config:
    """`python -m jaxlong.train --fit`: search, then `cfg` with the winner's overrides, printed one per line.

    Raises:
      ConfigError: bad flags, or nothing fits (the message names the closest candidate).
    """
    base = copy.deepcopy(cfg)
    target, budget, host_budget, collectives = resolve(args, cfg)
    prepare_jax(cfg, target)
    res = run_cli(args, cfg, target, budget, host_budget, collectives, argv_overrides, base)
    if res.winner is None:
        raise FitError("--fit: nothing fits the budget; see the table above")
    out = configure(cfg, res.winner["overrides"].split())
    validate(out)
    for o in winner_overrides(res, base):
        print(f"fit: {o}")
    return out

"""Command line of the memory planner: `python -m jaxlong.memory [--target GPU] [--config FILE] [--ladder]
[--max-context] [--estimate] [--fit [--max-compiles K]] [key=value ...]`.

`--estimate` (GPU targets) adds, per rung, the compiled step's FLOPs, HBM and collective bytes and a roofline
estimate of step time, tokens/s per GPU and MFU (`jaxlong.plan.cost`), with its assumptions under the table.
`--fit` searches the memory/speed options for the fastest configuration that fits (`jaxlong.plan.fit`).

The planning itself is in `jaxlong.plan`; this module parses arguments, picks where to compile (a GPU target,
the GPUs present, or the CPU approximation) and prints tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from jaxlong.config import Config, ConfigError, load_config, validate
from jaxlong.core import distributed, xla_log
from jaxlong.core.errors import ArgumentParser, fail
from jaxlong.core.units import fmt_gib
from jaxlong.plan import fit_report as fit_cli
from jaxlong.plan.cost import format_estimate_table, significant
from jaxlong.plan.planner import (
    HOST_BUDGET,
    budgets,
    format_context,
    format_table,
    ladder,
    max_context,
    plan,
    plot_ladder,
)
from jaxlong.plan.planner import __doc__ as _PLAN_DOC
from jaxlong.plan.target import Target, cuda_plugin_available, parse_target
from jaxlong.plan.workspace import parse_headroom

CPU_NOTICE = ("note: CPU approximation (XLA's CPU compiler, float32 compile scaled to the compute dtype; no "
              "attention workspace, collective buffers or headroom). For the GPU compiler's plan: "
              "pip install 'jax[cuda12]' and add --target h100 (or h200, a100).")


def _gpu_present() -> bool:
    return distributed.gpu_driver_present()


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m jaxlong.memory", description=_PLAN_DOC,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--target", default=None,
                   help="plan for a GPU without one: h100, h200, a100 or a GpuTargetConfigProto .txtpb, "
                        "[:DEVICES_PER_NODE][xNODES], e.g. h100:8x2 (sets mesh.num_devices)")
    p.add_argument("--budget", default=None,
                   help="per-device memory budget (default: the target's memory, else 80GiB)")
    p.add_argument("--host-budget", default=HOST_BUDGET,
                   help=f"host memory per node for offloaded bytes (default {HOST_BUDGET}: what a 2 TB node can pin)")
    p.add_argument("--headroom", default="2%", help="fragmentation headroom, %% of device memory or a size")
    p.add_argument("--collective-buffers", default=None, help="NCCL buffers per device (default: modelled)")
    p.add_argument("--ladder", action="store_true", help="add the techniques one at a time (paper Fig. 1)")
    p.add_argument("--max-context", action="store_true",
                   help="largest seq_len that fits (for the config, or per rung with --ladder)")
    p.add_argument("--estimate", action="store_true",
                   help="also count the compiled step's FLOPs, HBM and collective bytes and estimate step time, "
                        "tokens/s per GPU and MFU (roofline; needs a GPU target)")
    p.add_argument("--start", type=int, default=None,
                   help="first length the max-context search tries, tokens (default 262144 on a GPU target, "
                        "else 65536); the search doubles from it")
    p.add_argument("--out", default=None, help="directory for ladder .md/.csv/.png")
    p.add_argument("--dump", default=None, help="XLA dump directory (buffer assignment, memory-usage report)")
    p.add_argument("overrides", nargs="*")
    fit_cli.add_arguments(p, planner_options=False)
    return p


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What the flags resolve to: the config, the GPU target (None: the devices present or the CPU approximation),
    the budgets (bytes per device, host bytes per node), the NCCL buffers per device (bytes, None: modelled) and
    the first length the max-context search tries (tokens)."""

    cfg: Config
    target: Target | None
    budget: int
    host_budget: int
    collectives: int | None
    start: int


def main(argv: list[str] | None = None) -> int:
    """`python -m jaxlong.memory` with `argv` (default: the command line): prints the plan of the config or of each
    rung, writes `--out`. Returns the exit status: 0, 1 when `--fit` finds nothing that fits, 2 on bad input."""
    args = _parser().parse_args(argv)
    if args.fit:  # the fastest configuration that fits (`jaxlong.plan.fit`), for a config or each stage of a recipe
        from jaxlong.memory import recipe_fit  # noqa: PLC0415

        return recipe_fit.main(args, args.overrides)
    try:
        setup = _setup(args)
    except (ConfigError, ValueError) as e:
        return fail(e)
    cfg = setup.cfg
    if args.dump:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.dump}".strip()
    fit_cli.prepare_jax(cfg, setup.target)
    where = setup.target.describe() if setup.target else f"{cfg.mesh.num_devices} devices"
    print(f"{cfg.model.name}: seq_len {cfg.seq_len:,}, {where}, budget {fmt_gib(setup.budget)} GiB per device, "
          f"host {fmt_gib(setup.host_budget)} GiB per node, compute {cfg.compute_dtype}")
    rungs = ladder(cfg) if args.ladder else [("config", "as given", cfg)]
    with xla_log.collecting() as log:  # XLA's warnings of over-budget rungs: one summary line after the table
        try:
            rows = _plan_rungs(args, setup, rungs)
        except ConfigError as e:  # the config itself (one rung) is invalid
            return fail(e)
    if not rows:
        return fail("no rung of the ladder is valid for this config")
    table, source = _print_tables(args, setup, rows)
    for line in log.summary():
        print(line)
    if args.out:
        _write(args, argv, cfg, rows, table, source, setup.budget)
    return 0


def _setup(args) -> _Setup:
    """The config for the target's devices and the checked flags (`_Setup`).

    Raises:
      ConfigError / ValueError: a bad flag or config, or flags that do not go together, named.
    """
    target = _target(args)
    # The target's devices are the mesh's: the config is validated for them (e.g. mesh.ring=2 on h100:8x2).
    devices = [f"mesh.num_devices={target.devices}"] if target else []
    cfg = load_config(args.config, [*args.overrides, *devices])
    if cfg.stages:  # planned as one config here (its stages: --fit with the recipe): validated as one
        validate(cfg)
    if args.estimate and (target is None and not _gpu_present()):
        raise ConfigError("--estimate needs a GPU target (--target h100, h200 or a100, with the CUDA plugin): "
                          "the CPU compile's blockwise attention loops cannot be counted")
    if args.estimate and args.max_context:
        raise ConfigError("--estimate and --max-context together are not supported; estimate at a seq_len")
    budget, host_budget, collectives = budgets(args.budget, args.host_budget, args.collective_buffers, target,
                                               cfg.mesh.num_devices)
    _check_planning(args, cfg, target, budget)
    start = args.start if args.start is not None else (262144 if target else 65536)  # max-context's first length
    return _Setup(cfg, target, budget, host_budget, collectives, start)


def _target(args) -> Target | None:
    """The `--target` GPU; None without `--target`, or without the CUDA plugin (a note on stderr: planned on the CPU).

    Raises:
      ConfigError: an unknown GPU or a bad spec.
    """
    if not args.target:
        return None
    if cuda_plugin_available():
        return parse_target(args.target)
    print(f"note: --target {args.target} needs the CUDA plugin (pip install 'jax[cuda12]'); "
          f"planning on the CPU instead", file=sys.stderr)
    return None


def _check_planning(args, cfg: Config, target: Target | None, budget: int) -> None:
    """`--headroom` (with a unit, within bounds of the `budget` bytes), `--start` (positive) and a GPU-only attention
    backend (needs a GPU target or GPUs).

    Raises:
      ConfigError: the first check that fails, named.
    """
    if re.fullmatch(r"\s*[0-9.]+\s*", args.headroom):
        raise ConfigError(f"--headroom {args.headroom!r} has no unit; give a percentage of device memory "
                          f"('2%') or a size ('1GiB')")
    if args.start is not None and args.start <= 0:
        raise ConfigError(f"--start {args.start}: the first length the max-context search tries must be a "
                          f"positive number of tokens (default 262144 with --target, else 65536)")
    parse_headroom(args.headroom, budget)  # checked here, used per plan
    if cfg.attention.backend in ("cudnn", "pallas") and target is None and not _gpu_present():
        raise ConfigError(f"attention.backend={cfg.attention.backend} compiles only for NVIDIA GPUs; plan it with "
                          f"--target h100 (or h200, a100), or use attention.backend=auto")


def _plan_rungs(args, setup: _Setup, rungs: list) -> list[dict]:
    """A row per valid rung (`(name, what, config)`), each printed as it is planned; a rung invalid for this model
    is named on stderr and skipped.

    Raises:
      ConfigError: the only rung (the config as given) is invalid.
    """
    rows = []
    for name, what, c in rungs:
        try:
            row = _plan_rung(args, setup, name, c)
        except ConfigError as e:  # e.g. a ladder rung's context degree that the model's heads cannot split
            if len(rungs) == 1:
                raise
            print(f"{name:18s} invalid for this model: {e}", file=sys.stderr, flush=True)
            continue
        rows.append({"name": name, "what": what, **row})
    return rows


def _plan_rung(args, setup: _Setup, name: str, c: Config) -> dict:
    """One rung's plan (with `--max-context`, at its largest fitting length, `max_context`), printed on one line
    (and its estimate on a second with `--estimate`)."""
    kw = dict(headroom=args.headroom, collective_buffers=setup.collectives)
    if args.max_context:
        s, p = max_context(c, setup.budget, target=setup.target, host_budget=setup.host_budget, start=setup.start,
                           **kw)
        row = {**(p or {k: float("nan") for k in ("params", "gradients", "optimizer", "activations", "host", "peak",
                                                  "workspace", "collectives", "headroom", "total", "host_per_node")}),
               "max_context": s}
        print(f"{name:18s} max context {format_context(s, setup.start):>11s} tokens  (total "
              f"{fmt_gib(row['total'])} GiB per device, host {fmt_gib(row['host_per_node'])} GiB per node)",
              flush=True)
        return row
    row = dict(plan(c, setup.target, estimate=args.estimate, **kw), seq_len=c.seq_len)
    print(f"{name:18s} total {fmt_gib(row['total']):>8s} GiB  (compiled peak {fmt_gib(row['peak'])}, "
          f"activations {fmt_gib(row['activations'])}, host {fmt_gib(row['host'])})", flush=True)
    if "estimate" in row:
        e = row["estimate"]
        print(f"{'':18s} estimate: {significant(e['step_seconds'])} s/step, {e['tokens_per_s_per_gpu']:,.0f} "
              f"tokens/s per GPU, MFU {e['mfu']:.1%}, recompute {e['recompute_factor']:.2f}", flush=True)
    return row


def _print_tables(args, setup: _Setup, rows: list[dict]) -> tuple[str, str]:
    """Print the compile's source, the table of the rungs (of their max contexts with `--max-context`), the
    estimates with `--estimate` and the CPU approximation's notice. Returns (the tables as written to `--out`,
    the source)."""
    table = format_table(rows, setup.budget, setup.host_budget)
    if args.max_context:
        table = ("| rung | max context (tokens) | total at it (GiB per device) | host at it (GiB per node) |\n"
                 "|---|---:|---:|---:|\n") + "\n".join(
            f"| {r['name']} | {format_context(r['max_context'], setup.start)} | {fmt_gib(r['total'])} | "
            f"{fmt_gib(r['host_per_node'])} |" for r in rows)
    source = next((r["source"] for r in reversed(rows) if "source" in r), "")  # the full mesh, not rung 1's
    print(f"source: {source}")
    print(table)
    if args.estimate:
        table += "\n\n" + format_estimate_table(rows)
        print(format_estimate_table(rows))
    if any(str(r.get("source", "")).startswith("CPU") for r in rows):
        print(CPU_NOTICE)
    return table, source


def _write(args, argv, cfg, rows, table, source, budget) -> None:
    import csv  # noqa: PLC0415

    os.makedirs(args.out, exist_ok=True)
    kind = "maxctx" if args.max_context else "ladder" if args.ladder else "plan"
    tag = f"_{args.target.replace(':', '-')}" if args.target else "_cpu"
    stem = os.path.join(args.out, f"memory_{kind}_{cfg.model.name}{tag}")
    with open(stem + ".csv", "w", newline="") as f:
        flat = [{**{k: v for k, v in r.items() if k not in ("compiled", "estimate")},
                 **{f"est_{k}": v for k, v in r.get("estimate", {}).items() if k not in ("assumptions", "warnings")}}
                for r in rows]
        w = csv.DictWriter(f, fieldnames=list(flat[0]), extrasaction="ignore")
        w.writeheader()
        w.writerows(flat)
    with open(stem + ".md", "w") as f:
        f.write(f"python -m jaxlong.memory {' '.join(argv if argv is not None else sys.argv[1:])}\n\n"
                f"source: {source}\n\n{table}\n")
    if args.ladder and not args.max_context:
        plot_ladder(rows, budget, stem + ".png", f"{cfg.model.name}, {cfg.seq_len:,} tokens, {source}")
    print(f"wrote {stem}.csv/.md" + ("/.png" if args.ladder and not args.max_context else ""))


if __name__ == "__main__":
    sys.exit(main())

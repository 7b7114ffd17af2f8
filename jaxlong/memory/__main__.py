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
import os
import re
import sys

from jaxlong.config import ConfigError, load_config, validate
from jaxlong.core import distributed, xla_log
from jaxlong.core.errors import ArgumentParser, fail
from jaxlong.core.units import fmt_gib
from jaxlong.memory import fit_options as fit_cli
from jaxlong.plan.cost import significant
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

TiB = 1024**4
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.fit:  # the fastest configuration that fits (`jaxlong.plan.fit`), for a config or each stage of a recipe
        from jaxlong.memory import recipe_fit  # noqa: PLC0415

        return recipe_fit.main(args, args.overrides)
    try:
        target = None
        if args.target:
            if _target_usable():
                from jaxlong.plan.target import parse_target  # noqa: PLC0415

                target = parse_target(args.target)
            else:
                print(f"note: --target {args.target} needs the CUDA plugin (pip install 'jax[cuda12]'); "
                      f"planning on the CPU instead", file=sys.stderr)
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
        if re.fullmatch(r"\s*[0-9.]+\s*", args.headroom):
            raise ConfigError(f"--headroom {args.headroom!r} has no unit; give a percentage of device memory "
                              f"('2%') or a size ('1GiB')")
        if args.start is not None and args.start <= 0:
            raise ConfigError(f"--start {args.start}: the first length the max-context search tries must be a "
                              f"positive number of tokens (default 262144 with --target, else 65536)")
        from jaxlong.plan.workspace import parse_headroom  # noqa: PLC0415

        parse_headroom(args.headroom, budget)  # checked here, used per plan
        if cfg.attention.backend in ("cudnn", "pallas") and target is None and not _gpu_present():
            raise ConfigError(f"attention.backend={cfg.attention.backend} compiles only for NVIDIA GPUs; plan it with "
                              f"--target h100 (or h200, a100), or use attention.backend=auto")
    except (ConfigError, ValueError) as e:
        return fail(e)
    if target is not None and not _gpu_present():
        distributed.use_cpu_platform()  # the CUDA plugin must not try to initialize a driver
    if args.dump:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={args.dump}".strip()
    distributed.set_host_device_count(cfg.mesh.num_devices)
    where = target.describe() if target else f"{cfg.mesh.num_devices} devices"
    print(f"{cfg.model.name}: seq_len {cfg.seq_len:,}, {where}, budget {fmt_gib(budget)} GiB per device, "
          f"host {fmt_gib(host_budget)} GiB per node, compute {cfg.compute_dtype}")
    rungs = ladder(cfg) if args.ladder else [("config", "as given", cfg)]
    kw = dict(headroom=args.headroom, collective_buffers=collectives)
    start = args.start if args.start is not None else (262144 if target else 65536)  # first length the max-context search tries
    rows, cpu = [], False
    with xla_log.collecting() as log:  # XLA's warnings of over-budget rungs: one summary line after the table
        for name, what, c in rungs:
            row = {"name": name, "what": what}
            try:
                if args.max_context:
                    s, p = max_context(c, budget, target=target, host_budget=host_budget, start=start, **kw)
                    row.update(p or {k: float("nan") for k in ("params", "gradients", "optimizer", "activations", "host",
                                                               "peak", "workspace", "collectives", "headroom", "total",
                                                               "host_per_node")})
                    row["max_context"] = s
                    print(f"{name:18s} max context {format_context(s, start):>11s} tokens  (total "
                          f"{fmt_gib(row['total'])} GiB per device, host {fmt_gib(row['host_per_node'])} GiB per node)",
                          flush=True)
                else:
                    row.update(plan(c, target, estimate=args.estimate, **kw), seq_len=c.seq_len)
                    print(f"{name:18s} total {fmt_gib(row['total']):>8s} GiB  (compiled peak {fmt_gib(row['peak'])}, "
                          f"activations {fmt_gib(row['activations'])}, host {fmt_gib(row['host'])})", flush=True)
                    if "estimate" in row:
                        e = row["estimate"]
                        print(f"{'':18s} estimate: {significant(e['step_seconds'])} s/step, {e['tokens_per_s_per_gpu']:,.0f} "
                              f"tokens/s per GPU, MFU {e['mfu']:.1%}, recompute {e['recompute_factor']:.2f}", flush=True)
            except ConfigError as e:  # e.g. a ladder rung's context degree that the model's heads cannot split
                if len(rungs) == 1:
                    return fail(e)
                print(f"{name:18s} invalid for this model: {e}", file=sys.stderr, flush=True)
                continue
            cpu = cpu or str(row.get("source", "")).startswith("CPU")
            rows.append(row)
    if not rows:
        return fail("no rung of the ladder is valid for this config")
    table = format_table(rows, budget, host_budget)
    if args.max_context:
        table = ("| rung | max context (tokens) | total at it (GiB per device) | host at it (GiB per node) |\n"
                 "|---|---:|---:|---:|\n") + "\n".join(
            f"| {r['name']} | {format_context(r['max_context'], start)} | {fmt_gib(r['total'])} | "
            f"{fmt_gib(r['host_per_node'])} |" for r in rows)
    source = next((r["source"] for r in reversed(rows) if "source" in r), "")  # the full mesh, not rung 1's
    print(f"source: {source}")
    print(table)
    if args.estimate:
        from jaxlong.plan.cost import format_estimate_table  # noqa: PLC0415

        table += "\n\n" + format_estimate_table(rows)
        print(format_estimate_table(rows))
    if cpu:
        print(CPU_NOTICE)
    for line in log.summary():
        print(line)
    if args.out:
        _write(args, argv, cfg, rows, table, source, budget)
    return 0


def _target_usable() -> bool:
    from jaxlong.plan.target import cuda_plugin_available  # noqa: PLC0415

    return cuda_plugin_available()


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

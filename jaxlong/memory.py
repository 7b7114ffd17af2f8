"""Command line of the memory planner: `python -m jaxlong.memory [--config FILE] [--ladder] [--max-context] ...`.

The planning itself is in `jaxlong.plan`; this module parses arguments and prints tables.
"""

from __future__ import annotations

import argparse
import sys

from jaxlong.config import ConfigError, load_config
from jaxlong.plan.planner import __doc__ as _PLAN_DOC
from jaxlong.plan.planner import _ctx, _gib, format_table, ladder, max_context, parse_bytes, plan, plot_ladder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxlong.memory", description=_PLAN_DOC,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None)
    parser.add_argument("--budget", default="80GiB", help="per-device memory budget (default 80GiB)")
    parser.add_argument("--ladder", action="store_true", help="add the techniques one at a time (paper Fig. 1)")
    parser.add_argument("--max-context", action="store_true", help="largest seq_len that fits, per rung")
    parser.add_argument("--out", default=None, help="directory for ladder .md/.csv/.png")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        budget = parse_bytes(args.budget)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from jaxlong.train import set_host_device_count  # noqa: PLC0415

    set_host_device_count(cfg.mesh.num_devices)
    print(f"{cfg.model.name}: seq_len {cfg.seq_len}, {cfg.mesh.num_devices} devices, budget {_gib(budget)} GiB "
          f"(compute {cfg.compute_dtype}; activations measured in float32 and scaled)")
    rungs = ladder(cfg) if (args.ladder or args.max_context) else [("config", "as given", cfg)]
    rows = []
    for name, what, c in rungs:
        row = {"name": name, "what": what}
        try:
            if args.max_context:
                s, p = max_context(c, budget)
                row.update(p or {k: float("nan") for k in ("params", "gradients", "optimizer", "activations", "host", "peak")})
                row["max_context"] = s
                print(f"{name:18s} max context {_ctx(s):>11s} tokens", flush=True)
            else:
                row.update(plan(c))
                print(f"{name:18s} peak {_gib(row['peak']):>8s} GiB  (activations {_gib(row['activations'])}, "
                      f"host {_gib(row['host'])})", flush=True)
        except ConfigError as e:  # e.g. a ladder rung's context degree that the model's heads cannot split
            print(f"{name:18s} invalid for this model: {e}", file=sys.stderr, flush=True)
            if len(rungs) == 1:
                return 2
            continue
        rows.append(row)
    if not rows:
        print("error: no rung of the ladder is valid for this config", file=sys.stderr)
        return 2
    table = format_table(rows, budget)
    if args.max_context:
        table = "| rung | max context (tokens) |\n|---|---:|\n" + "\n".join(
            f"| {r['name']} | {_ctx(r['max_context'])} |" for r in rows)
    print(table)
    if args.out:
        import csv  # noqa: PLC0415
        import os  # noqa: PLC0415

        os.makedirs(args.out, exist_ok=True)
        kind = "maxctx" if args.max_context else "ladder" if args.ladder else "plan"
        stem = os.path.join(args.out, f"memory_{kind}_{cfg.model.name}")
        with open(stem + ".csv", "w", newline="") as f:
            keys = [k for k in rows[0] if k != "compiled"]
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        with open(stem + ".md", "w") as f:
            f.write(f"python -m jaxlong.memory {' '.join(argv if argv is not None else sys.argv[1:])}\n\n{table}\n")
        if args.ladder and not args.max_context:
            plot_ladder(rows, budget, stem + ".png", f"{cfg.model.name}, {cfg.seq_len:,} tokens, {cfg.mesh.num_devices} devices")
        print(f"wrote {stem}.csv/.md" + ("/.png" if args.ladder and not args.max_context else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())


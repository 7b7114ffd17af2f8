"""U-Pipe vs Ulysses: compiled per-device memory of one attention layer and of the train step, next to the
analytic model (`jaxlong.parallel.upipe.attention_memory_model`), and tokens/s of each variant measured side by side.

For each model shape, at `--seq` tokens on the `--mesh` (data,fsdp,context), with simulated CPU devices:
  * one attention layer (normalized input -> output before W_o), forward and forward + backward (a `jax.vjp`
    with the cotangent as an argument), Ulysses and U-Pipe at every valid U (H, ..., C): temp bytes from
    `memory_analysis` and the model's bytes; compile only, nothing is allocated;
  * the whole train step (`jaxlong.training.step.compile_train_step`) of the shape's config with `attention.impl`
    overridden: argument/output/temp bytes;
  * tokens/s of the layer's forward + backward at small `--time-*` shapes, all variants compiled first, then
    timed round-robin (rotating the order each round) `--time-reps` times; median and best.
Everything is float32: XLA's CPU backend computes bf16 matmuls and all-to-alls in float32, so bf16 figures
would not be what a GPU uses. Writes `<out>.md`, `<out>_memory.csv`, `<out>_speed.csv` and `<out>.png`.

  python experiments/upipe_sweep.py                      # Llama3-8B and Qwen3-32B shapes, S = 256K, C = 8
  python experiments/upipe_sweep.py --shapes llama3-8b --seq 524288 --no-step --time-reps 3
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRESETS = {  # name: (heads, kv_heads, head_dim, hidden, config file for the train step)
    "llama3-8b": (32, 8, 128, 4096, "configs/llama3_1_8b.yaml"),
    "qwen3-32b": (64, 8, 128, 5120, "configs/qwen3_32b.yaml"),
}
PAPER = {  # U-Pipe paper (arXiv 2602.21196) figures quoted in the design brief
    "llama3-8b": "attention activations 33.0 -> 19.5 GiB (ratio 0.59), Llama3-8B at 3M tokens, 8xH100, full stack",
    "qwen3-32b": "87.5% less query-side memory at 64 heads (U = C = 8; ratio 0.125)",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama3-8b,qwen3-32b",
                   help="comma-separated presets (%s) or NAME=H:H_kv:d:hidden" % ", ".join(PRESETS))
    p.add_argument("--seq", type=int, default=262144, help="global sequence length S for the memory sweep")
    p.add_argument("--mesh", default="1,1,8", help="data,fsdp,context")
    p.add_argument("--us", default="", help="comma-separated heads per stage (default: every valid U)")
    p.add_argument("--block", type=int, default=1024, help="attention block_q = block_k for the memory sweep")
    p.add_argument("--no-step", dest="step", action="store_false", help="skip the train-step compiles")
    p.add_argument("--step-layers", type=int, default=2, help="decoder layers of the compiled train step")
    p.add_argument("--step-overrides", default="remat.policy=full tiling.loss=true tiling.mlp=true",
                   help="extra key=value overrides (space-separated) for the train step")
    p.add_argument("--time-shape", default="32,8,64,1024", help="H,H_kv,d,hidden of the timed layer")
    p.add_argument("--time-seq", type=int, default=4096)
    p.add_argument("--time-block", type=int, default=512)
    p.add_argument("--time-reps", type=int, default=7)
    p.add_argument("--no-time", dest="time", action="store_false", help="skip the timing")
    p.add_argument("--out", default=str(ROOT / "experiments/results/upipe_sweep"), help="output path prefix")
    return p.parse_args(argv)


def shapes_of(spec: str) -> dict[str, tuple]:
    shapes = {}
    for item in spec.split(","):
        if "=" in item:
            name, dims = item.split("=")
            h, hkv, d, hid = (int(v) for v in dims.split(":"))
            shapes[name] = (h, hkv, d, hid, None)
        else:
            shapes[item] = PRESETS[item]
    return shapes


def valid_us(heads: int, kv_heads: int, context: int) -> list[int]:
    from jaxlong.config import ConfigError  # noqa: PLC0415
    from jaxlong.parallel.upipe import Schedule  # noqa: PLC0415

    out = []
    for u in range(heads, context - 1, -context):
        try:
            Schedule(heads, kv_heads, context, u).validate()
            out.append(u)
        except ConfigError:
            pass
    return out


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache", "L3 cache")
    lines = [" ".join(ln.split()) for ln in lscpu.splitlines() if ln.split(":")[0].strip() in keep]
    mem = ""
    if Path("/proc/meminfo").exists():
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f"{kb / 2**20:.1f} GiB RAM"
    nproc = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return "; ".join(lines) + f"; nproc {nproc}; {mem}; {platform.platform()}"


# ------------------------------------------------------------------------------------------- measurements


def layer_inputs(mesh, b, seq, heads, kv_heads, d, hidden):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P

    act = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((b, seq, hidden), jnp.float32, sharding=act)
    ws = [jax.ShapeDtypeStruct((hidden, n, d), jnp.float32, sharding=rep) for n in (heads, kv_heads, kv_heads)]
    ct = jax.ShapeDtypeStruct((b, seq, heads, d), jnp.float32, sharding=act)
    return x, ws, ct


def fwd_bwd(layer):
    import jax  # noqa: PLC0415

    def f(x, wq, wk, wv, ct):
        _, vjp = jax.vjp(layer, x, wq, wk, wv)
        return vjp(ct)

    return f


def memory_sweep(args, mesh, name, shape, us):
    import jax  # noqa: PLC0415

    from jaxlong.parallel.upipe import attention_layer, attention_memory_model  # noqa: PLC0415

    heads, kv_heads, d, hidden, _ = shape
    data, fsdp, context = mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["context"]
    b = data * fsdp
    x, ws, ct = layer_inputs(mesh, b, args.seq, heads, kv_heads, d, hidden)
    rows = []
    for impl, u in [("ulysses", None)] + [("upipe", u) for u in us]:
        layer = attention_layer(impl, mesh, heads_per_stage=u, backend="blockwise", block_q=args.block,
                                block_k=args.block)
        for phase, fn, ins in (("fwd", layer, (x, *ws)), ("fwd+bwd", fwd_bwd(layer), (x, *ws, ct))):
            t0 = time.time()
            temp = jax.jit(fn).lower(*ins).compile().memory_analysis().temp_size_in_bytes
            model = attention_memory_model(impl, 1, args.seq, heads, kv_heads, d, hidden, context, u, 4,
                                           phase == "fwd+bwd")
            rows.append(dict(shape=name, seq=args.seq, mesh=args.mesh, what="layer", impl=impl, U=u or "",
                             phase=phase, measured_temp=temp, model_temp=sum(model.values()),
                             model_terms="; ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in model.items())))
            print(f"  {name} layer {impl:7s} U={u or '-':>3} {phase:7s} temp {temp / 2**20:8.0f} MiB  "
                  f"model {sum(model.values()) / 2**20:8.0f} MiB  ({time.time() - t0:.1f}s)", flush=True)
    return rows


def step_sweep(args, mesh, name, shape, us):
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.core.memstats import compiled_bytes  # noqa: PLC0415
    from jaxlong.training.step import compile_train_step  # noqa: PLC0415

    data, fsdp, context = (int(v) for v in args.mesh.split(","))
    rows = []
    for impl, u in [("ulysses", 0)] + [("upipe", u) for u in us]:
        overrides = [f"seq_len={args.seq}", f"model.layers={args.step_layers}", f"mesh.data={data}",
                     f"mesh.fsdp={fsdp}", f"mesh.context={context}", f"mesh.num_devices={data * fsdp * context}",
                     f"global_batch={data * fsdp}", "compute_dtype=float32", "param_dtype=float32",
                     f"attention.impl={impl}", f"attention.heads_per_stage={u}", "attention.backend=blockwise",
                     f"attention.block_q={args.block}", f"attention.block_k={args.block}",
                     *args.step_overrides.split()]
        cfg = load_config(ROOT / shape[4], overrides)
        t0 = time.time()
        b = compiled_bytes(compile_train_step(cfg, mesh))
        rows.append(dict(shape=name, seq=args.seq, mesh=args.mesh, what="train_step", impl=impl, U=u or "",
                         phase="step", measured_temp=b["temp"], model_temp="", argument=b["argument"],
                         output=b["output"], alias=b["alias"], peak=b["peak"],
                         model_terms=" ".join(overrides)))
        print(f"  {name} train step {impl:7s} U={u or '-':>3} temp {b['temp'] / 2**20:8.0f} MiB  "
              f"args {b['argument'] / 2**20:.0f} MiB  ({time.time() - t0:.1f}s)", flush=True)
    return rows


def speed_sweep(args, mesh):
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P

    from jaxlong.parallel.upipe import attention_layer  # noqa: PLC0415

    heads, kv_heads, d, hidden = (int(v) for v in args.time_shape.split(","))
    context = mesh.shape["context"]
    b, seq = mesh.shape["data"] * mesh.shape["fsdp"], args.time_seq
    keys = jax.random.split(jax.random.key(0), 5)
    act = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    x = jax.device_put(jax.random.normal(keys[0], (b, seq, hidden)), act)
    ws = [jax.random.normal(k, (hidden, n, d)) / hidden**0.5 for k, n in zip(keys[1:4], (heads, kv_heads, kv_heads))]
    ct = jax.device_put(jax.random.normal(keys[4], (b, seq, heads, d)), act)
    variants = {}
    for impl, u in [("ulysses", None)] + [("upipe", u) for u in valid_us(heads, kv_heads, context)]:
        layer = attention_layer(impl, mesh, heads_per_stage=u, backend="blockwise", block_q=args.time_block,
                                block_k=args.time_block)
        f = jax.jit(fwd_bwd(layer))
        jax.block_until_ready(f(x, *ws, ct))  # compile + warm up
        jax.block_until_ready(f(x, *ws, ct))
        variants[(impl, u)] = f
    times = {k: [] for k in variants}
    order = list(variants)
    for rep in range(args.time_reps):
        for k in order[rep % len(order):] + order[: rep % len(order)]:  # rotate who goes first
            t0 = time.perf_counter()
            jax.block_until_ready(variants[k](x, *ws, ct))
            times[k].append(time.perf_counter() - t0)
    base = float(np.median(times[("ulysses", None)]))
    rows = []
    for (impl, u), ts in times.items():
        med, best = float(np.median(ts)), float(np.min(ts))
        rows.append(dict(impl=impl, U=u or "", time_shape=args.time_shape, seq=seq, mesh=args.mesh, reps=len(ts),
                         median_s=med, best_s=best, tokens_per_s=b * seq / med, best_tokens_per_s=b * seq / best,
                         vs_ulysses=base / med, times_s=" ".join(f"{t:.3f}" for t in ts)))
        print(f"  speed {impl:7s} U={u or '-':>3} median {med * 1e3:8.1f} ms  {b * seq / med:9.0f} tokens/s  "
              f"x{base / med:.3f} of Ulysses", flush=True)
    return rows


# -------------------------------------------------------------------------------------------------- output


def write_csv(path, rows):
    keys = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def mib(v):
    return f"{v / 2**20:,.0f}" if v != "" else ""


def markdown(args, command, shapes, mem_rows, speed_rows, png_name):
    import jax  # noqa: PLC0415

    out = ["# U-Pipe vs Ulysses: compiled memory and CPU throughput", "",
           f"Command: `{command}`", "",
           f"Machine: {machine()}", "",
           f"JAX {jax.__version__}, {jax.device_count()} simulated CPU devices, mesh (data, fsdp, context) = "
           f"({args.mesh}); written {datetime.datetime.now().isoformat(timespec='seconds')}.", "",
           "All tensors float32 (XLA's CPU backend computes bf16 matmuls and all-to-alls in float32, so bf16 "
           "figures would not be what a GPU uses). Bytes are per device, MiB, from `Compiled.memory_analysis()` "
           "(compile only, nothing allocated). `model` is `jaxlong.parallel.upipe.attention_memory_model` (per-tensor, see "
           "the module docstring of `jaxlong/parallel/upipe.py`); error = (model - measured) / measured.", "",
           f"![memory]({png_name})", ""]
    for name, shape in shapes.items():
        heads, kv_heads, d, hidden, _ = shape
        rows = [r for r in mem_rows if r["shape"] == name and r["what"] == "layer"]
        uly = {r["phase"]: r for r in rows if r["impl"] == "ulysses"}
        out += [f"## {name}: H {heads}, H_kv {kv_heads}, d {d}, hidden {hidden}, S {args.seq:,}", "",
                "One attention layer (normalized input -> attention output before W_o):", "",
                "| variant | fwd measured | fwd model | err | fwd+bwd measured | fwd+bwd model | err | "
                "fwd+bwd / Ulysses (measured) | (model) |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for key in [("ulysses", "")] + sorted({(r["impl"], r["U"]) for r in rows if r["impl"] == "upipe"},
                                              key=lambda k: -k[1]):
            f = next(r for r in rows if (r["impl"], r["U"]) == key and r["phase"] == "fwd")
            fb = next(r for r in rows if (r["impl"], r["U"]) == key and r["phase"] == "fwd+bwd")
            label = "Ulysses" if key[0] == "ulysses" else f"U-Pipe U={key[1]}"
            err = lambda r: f"{(r['model_temp'] - r['measured_temp']) / r['measured_temp'] * 100:+.1f}%"
            out.append(f"| {label} | {mib(f['measured_temp'])} | {mib(f['model_temp'])} | {err(f)} | "
                       f"{mib(fb['measured_temp'])} | {mib(fb['model_temp'])} | {err(fb)} | "
                       f"{fb['measured_temp'] / uly['fwd+bwd']['measured_temp']:.2f} | "
                       f"{fb['model_temp'] / uly['fwd+bwd']['model_temp']:.2f} |")
        c = int(args.mesh.split(",")[2])
        at_c = [r["measured_temp"] for r in rows if r["U"] == c and r["phase"] == "fwd+bwd"]
        ratio = f"{at_c[0] / uly['fwd+bwd']['measured_temp']:.2f}" if at_c else "-"
        out += ["", f"Paper: {PAPER.get(name, '-')}. Here: U-Pipe (U = C = {c}) / Ulysses, one layer forward + "
                f"backward = {ratio} measured; the model's query-side terms scale by U/H = {c / heads:.3f} "
                f"({(1 - c / heads) * 100:.1f}% less).", ""]
        step = [r for r in mem_rows if r["shape"] == name and r["what"] == "train_step"]
        if step:
            base = next(r for r in step if r["impl"] == "ulysses")["measured_temp"]
            out += [f"Whole train step (`compile_train_step`, {args.step_layers} layers; overrides of the Ulysses row, "
                    f"the U-Pipe rows set `attention.impl=upipe attention.heads_per_stage=U`: "
                    f"`{step[0]['model_terms']}`):", "",
                    "| variant | arguments | outputs | temp | temp / Ulysses |", "|---|---:|---:|---:|---:|"]
            for r in step:
                label = "Ulysses" if r["impl"] == "ulysses" else f"U-Pipe U={r['U']}"
                out.append(f"| {label} | {mib(r['argument'])} | {mib(r['output'])} | {mib(r['measured_temp'])} | "
                           f"{r['measured_temp'] / base:.3f} |")
            out += ["", "The step's temp is its largest phase; a ratio near 1 means that phase is not the attention "
                    "layer (find it in the `*buffer-assignment.txt` / `*live-range.txt` of `--xla_dump_to`).", ""]
    if speed_rows:
        r0 = speed_rows[0]
        out += [f"## Throughput (CPU, one layer forward + backward, H,H_kv,d,hidden = {r0['time_shape']}, "
                f"S {r0['seq']:,}, {r0['reps']} rounds, order rotated each round)", "",
                "| variant | median s | tokens/s (median) | tokens/s (best) | vs Ulysses (median) |",
                "|---|---:|---:|---:|---:|"]
        for r in speed_rows:
            label = "Ulysses" if r["impl"] == "ulysses" else f"U-Pipe U={r['U']}"
            out.append(f"| {label} | {r['median_s']:.3f} | {r['tokens_per_s']:,.0f} | {r['best_tokens_per_s']:,.0f} | "
                       f"{r['vs_ulysses']:.3f} |")
        out.append("")
    return "\n".join(out)


def plot(path, args, shapes, mem_rows):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        rows = [r for r in mem_rows if r["shape"] == name and r["what"] == "layer"]
        for phase, color in (("fwd", "tab:blue"), ("fwd+bwd", "tab:red")):
            up = sorted((r for r in rows if r["impl"] == "upipe" and r["phase"] == phase), key=lambda r: r["U"])
            us = [r["U"] for r in up]
            ax.plot(us, [r["measured_temp"] / 2**30 for r in up], "o-", color=color, label=f"U-Pipe {phase}: measured")
            ax.plot(us, [r["model_temp"] / 2**30 for r in up], "x--", color=color, alpha=0.6,
                    label=f"U-Pipe {phase}: model")
            uly = next(r for r in rows if r["impl"] == "ulysses" and r["phase"] == phase)
            ax.axhline(uly["measured_temp"] / 2**30, color=color, ls=":", label=f"Ulysses {phase}: measured")
        ax.set_xscale("log", base=2)
        ax.set_xticks(us, [str(u) for u in us])
        ax.set_xlabel("heads per stage U")
        ax.set_ylabel("per-device temp GiB (float32)")
        ax.set_title(f"{name}, S={args.seq:,}, mesh {args.mesh}")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    args = parse_args(argv)
    data, fsdp, context = (int(v) for v in args.mesh.split(","))
    n = data * fsdp * context
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax  # noqa: PLC0415

    mesh = jax.make_mesh((data, fsdp, context), ("data", "fsdp", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *(argv or sys.argv[1:])])
    shapes = shapes_of(args.shapes)
    mem_rows = []
    for name, shape in shapes.items():
        us = [int(u) for u in args.us.split(",")] if args.us else valid_us(shape[0], shape[1], context)
        mem_rows += memory_sweep(args, mesh, name, shape, us)
        if args.step and shape[4]:
            mem_rows += step_sweep(args, mesh, name, shape, us)
    speed_rows = speed_sweep(args, mesh) if args.time else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_csv(f"{out}_memory.csv", mem_rows)
    if speed_rows:
        write_csv(f"{out}_speed.csv", speed_rows)
    plot(f"{out}.png", args, shapes, mem_rows)
    Path(f"{out}.md").write_text(markdown(args, command, shapes, mem_rows, speed_rows, f"{out.name}.png"))
    print(f"wrote {out}.md, {out}_memory.csv, {out}_speed.csv, {out}.png")


if __name__ == "__main__":
    main()

"""Generation at scale, by GPU compile: the prefill and the decode step of `jaxlong.generation.decode` for a long
prompt on one node, their per-device memory, the KV cache, and estimates of the time per token and per RULER case.

    python experiments/generation_scale.py --target h100 --lengths 131072,1048576,1048576:4m,4194304 \
        --out runs/generation_scale

No GPU is used. Each length is one XLA GPU compile of `make_prefill` and one of `make_decode_step` (the cache the
prefill returns as its donated input) for compile-only devices of `--target` (`jaxlong.plan.target`), on the
model and memory setup of a recipe stage (`--recipe`, default the shipped 8B recipe; `LENGTH:STAGE` picks the
stage, else the first stage whose `seq_len` is at least the length), batch 1, with `--param-dtype` weights.

Memory ("GPU compile"): `memory_analysis()` of each program, peak = arguments + outputs + temporaries - donated,
total = peak + the planner's NCCL-buffer model + its 2% headroom (`jaxlong.plan.workspace`; neither program runs
an attention backward, so no cuDNN workspace), against the target's memory (the planner's default budget).

Time ("estimate", not a measurement):
  decode, per token = (the device's prompt-cache slice + every weight in the compute dtype, read once) / HBM
      bandwidth + the FSDP all-gather of every weight (ring all-gather: (n-1)/n of the weights into each device,
      at the NVLink bandwidth per direction, not overlapped) + 2 latency-bound collectives per layer (pmax,
      psum) at `--collective-latency` each (the "model").
  decode "as compiled" = the same three terms from the decode HLO (`jaxlong.plan.cost`'s walker, which reads a
      dynamic-slice of a bitcast parameter as the slice: the layer's cache): every kernel's HBM bytes,
      the all-gathers' wire bytes, and every collective under 1 MiB at `--collective-latency`.
  prefill = the planner's roofline of the compiled prefill (`jaxlong.plan.cost.roofline`: FLOPs at 60% of the
      dense bf16 peak or HBM bytes, plus exposed all-to-alls).
  RULER case = prefill + tokens_to_generate (RULER's per family: niah 128, vt 30, cwe 120, fwe 50) x per token;
  a recipe gate = the sum over its lengths x tasks x cases.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CUDA plugin compiles for compile-only GPUs; no driver

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import apply_setting, load_config, parse_override, validate  # noqa: E402
from jaxlong.core import xla_log  # noqa: E402
from jaxlong.core.memstats import compiled_bytes  # noqa: E402
from jaxlong.core.mesh import BATCH_AXES, build_mesh, tree_shardings  # noqa: E402
from jaxlong.core.units import GiB  # noqa: E402
from jaxlong.evaluation.ruler.tasks import TASKS  # noqa: E402
from jaxlong.generation.chunked import ChunkedPrefill  # noqa: E402
from jaxlong.generation import decode as decode_lib  # noqa: E402
from jaxlong.generation.decode import make_decode_step, make_prefill  # noqa: E402
from jaxlong.models import llama as model_lib  # noqa: E402
from jaxlong.plan import workspace as ws  # noqa: E402
from jaxlong.plan import cost as cost_lib  # noqa: E402
from jaxlong.plan.cost import hlo_cost, roofline  # noqa: E402
from jaxlong.plan.target import compile_only_devices, parse_target  # noqa: E402
from jaxlong.recipes import expand  # noqa: E402
from jaxlong.training.step import batch_sharding  # noqa: E402

TOKENS_TO_GENERATE = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}  # RULER's synthetic task configs


def stage_config(stages, length: int, name: str | None, overrides: list[str]):
    st = next((s for s in stages if s.name == name), None) if name else \
        next((s for s in stages if s.cfg.seq_len >= length), stages[-1])
    if st is None:
        raise SystemExit(f"no stage named {name!r}; stages: {', '.join(s.name for s in stages)}")
    cfg = copy.deepcopy(st.cfg)
    for text in [f"seq_len={length}", *overrides]:
        apply_setting(cfg, *parse_override(text))
    validate(cfg, platform="gpu")
    return st, cfg


def abstract_inputs(cfg, mesh, b: int):
    params = model_lib.abstract_params(cfg.model, cfg.param_dtype)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                          tree_shardings(mesh, params))
    sh = batch_sharding(mesh)
    batch = {k: jax.ShapeDtypeStruct((b, cfg.seq_len), jnp.int32, sharding=sh)
             for k in ("inputs", "positions", "segment_ids")}
    return params, batch


def memory(compiled, target, n: int) -> dict:
    raw = compiled_bytes(compiled)
    extra = ws.collective_buffer_bytes(n) + ws.parse_headroom("2%", target.device_memory)
    return {**raw, "total": raw["peak"] + extra}


def cache_bytes(cfg, mesh, b: int, max_new: int) -> dict:
    """Per-device bytes of the cache from its shapes and shardings (`jaxlong.generation.decode.cache_shapes`): the
    global layers' prompt K/V, the generated tokens', the sliding-window layers' windows, the valid mask."""
    f = decode_lib.cache_bytes(decode_lib.cache_shapes(cfg, mesh, b, cfg.seq_len, max_new))
    parts = {"prompt": f["k"] + f["v"], "new": f["new_k"] + f["new_v"], "window": f["win_k"] + f["win_v"],
             "valid": f["valid"]}
    return {**parts, "total": sum(parts.values())}


def run_case(length, stage_name, stages, target, devices, args) -> dict:
    st, cfg = stage_config(stages, length, stage_name, [f"param_dtype={args.param_dtype}", *args.overrides])
    mesh, b, n = build_mesh(cfg.mesh, devices=devices), 1, len(devices)
    params, batch = abstract_inputs(cfg, mesh, b)
    row = {"length": length, "stage": st.name, "setup": setup_text(cfg), "batch": b, "max_new": args.max_new,
           "params_bytes": sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                               for x in jax.tree.leaves(params))}
    chunk = cfg.prefill_chunk if 0 < cfg.prefill_chunk < length else 0
    t0 = time.perf_counter()
    try:
        if chunk:  # one compiled step per chunk, the cache donated (`jaxlong.generation.chunked`)
            chunked = ChunkedPrefill(cfg, mesh, chunk, args.max_new)
            row["prefill_kernel"] = chunked.kernel
            prefill = xla_log.compile_logged(lambda: chunked.step_for(length).lower(
                params, *chunked.abstract_args(b, length)).compile())
        else:
            prefill = xla_log.compile_logged(lambda: make_prefill(cfg, mesh, args.max_new).lower(params, batch)
                                             .compile())
    except Exception as e:  # noqa: BLE001 (report the compiler's error, do not hide it)
        row["prefill_error"] = f"{type(e).__name__}: {e}"
        return row
    row["prefill_compile_s"] = time.perf_counter() - t0
    row["prefill"] = memory(prefill, target, n)
    row["cache"] = cache_bytes(cfg, mesh, b, args.max_new)
    row["prefill_chunk"] = chunk
    row["prefill_estimate"] = (chunked_prefill_estimate(cfg, prefill, target, n, length // chunk) if chunk else
                               prefill_estimate(cfg, prefill, target, n))
    del prefill
    cache = decode_lib.cache_shapes(cfg, mesh, b, cfg.seq_len, args.max_new)
    vec = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=NamedSharding(mesh, P(BATCH_AXES)))
    key = jax.eval_shape(lambda: jax.random.key(0))
    t0 = time.perf_counter()
    try:
        step = xla_log.compile_logged(lambda: make_decode_step(cfg, mesh).lower(
            params, cache, vec, vec, jax.ShapeDtypeStruct((), jnp.int32), key).compile())
    except Exception as e:  # noqa: BLE001
        row["decode_error"] = f"{type(e).__name__}: {e}"
        return row
    row["decode_compile_s"] = time.perf_counter() - t0
    row["decode"] = memory(step, target, n)
    row["decode_estimate"] = decode_estimate(cfg, params, row["cache"], step, target, n, args)
    return row


def setup_text(cfg) -> str:
    a = cfg.attention
    impl = f"U-Pipe U={a.heads_per_stage or cfg.mesh.context}" if a.impl == "upipe" else a.impl
    return (f"{impl}, context {cfg.mesh.context}, {'tiled MLP' if cfg.tiling.mlp else 'MLP untiled'}, "
            f"blocks {a.block_q}/{a.block_k}, params {cfg.param_dtype}, compute {cfg.compute_dtype}, "
            f"packing {cfg.data.packing}")


def forward_flops(cfg) -> float:
    """Model FLOPs of the prefill forward (all devices): 2 x layer matmul params per token + causal attention
    2 x S x H x d per layer and token, + the head for the last token."""
    m, s = cfg.model, cfg.seq_len
    per_layer = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden \
        + 3 * m.hidden * m.mlp_hidden
    attention = 2.0 * m.layers * s * s * m.heads * m.head_dim
    return 2.0 * m.layers * per_layer * s + attention + 2.0 * m.hidden * m.vocab_size


def chunked_prefill_estimate(cfg, compiled, target, n, chunks: int) -> dict:
    """The chunked prefill's roofline: `chunks` runs of the compiled chunk step, whose attention kernel is counted
    by the HLO over the whole cache shard, while it skips the slots below each query's bound: chunk j reads (j + 1)
    / chunks of them, (chunks + 1) / (2 chunks) on average, so the attention FLOPs are scaled by that."""
    cost = hlo_cost(compiled.as_text(), n, target.devices_per_node)
    skipped = cost.attention_flops * (1 - (chunks + 1) / (2 * chunks))
    cost = dataclasses.replace(cost, flops=cost.flops - skipped, attention_flops=cost.attention_flops - skipped)
    c = dataclasses.replace(cfg, seq_len=cfg.seq_len // chunks)
    e = roofline(cost, peak_flops=target.peak_flops, hbm_bandwidth=target.hbm_bandwidth,
                 link_bandwidth=target.link_bandwidth, network_bandwidth=None,
                 model_flops=forward_flops(cfg) / n / chunks, tokens=c.seq_len, devices=n)
    out = {k: e[k] * (chunks if k in ("flops", "model_flops", "hbm_bytes", "compute_seconds", "memory_seconds",
                                      "exposed_seconds", "step_seconds") else 1)
           for k in ("flops", "model_flops", "hbm_bytes", "compute_seconds", "memory_seconds", "exposed_seconds",
                     "step_seconds", "mfu", "warnings")}
    return {**out, "chunks": chunks, "attention_flops_per_chunk": cost.attention_flops}


def prefill_estimate(cfg, compiled, target, n) -> dict:
    cost = hlo_cost(compiled.as_text(), n, target.devices_per_node)
    e = roofline(cost, peak_flops=target.peak_flops, hbm_bandwidth=target.hbm_bandwidth,
                 link_bandwidth=target.link_bandwidth, network_bandwidth=None,
                 model_flops=forward_flops(cfg) / n, tokens=cfg.seq_len, devices=n)
    return {k: e[k] for k in ("flops", "model_flops", "hbm_bytes", "compute_seconds", "memory_seconds",
                              "exposed_seconds", "step_seconds", "mfu", "warnings")}


def decode_estimate(cfg, params, cache, compiled, target, n, args) -> dict:
    """Seconds per token: `model` (the module docstring's formula) and `compiled` (the same with the decode HLO's
    own HBM bytes, all-gather wire bytes and count of small collectives)."""
    item = jnp.dtype(cfg.compute_dtype).itemsize
    weights = sum(math.prod(x.shape) for x in jax.tree.leaves(params)) * item  # every weight, gathered, per token
    gathered = weights * (n - 1) / n  # ring all-gather: what each device receives
    hbm_s = (cache["prompt"] + cache["window"] + weights) / target.hbm_bandwidth
    gather_s = gathered / target.link_bandwidth
    small_s = 2 * cfg.model.layers * args.collective_latency
    text = compiled.as_text()
    comps, entry = cost_lib.parse_module(text)
    walker = cost_lib._Walker(comps, n, target.devices_per_node)
    cost = walker.cost(entry)
    small = count_collectives(walker, entry, below=1 << 20)
    wire = cost.collective_wire_bytes.get("all-gather", 0)
    compiled_s = cost.hbm_bytes / target.hbm_bandwidth + wire / target.link_bandwidth + small * args.collective_latency
    return {"weights_bytes": weights, "gathered_bytes_per_device": gathered, "hbm_seconds": hbm_s,
            "gather_seconds": gather_s, "small_collective_seconds": small_s, "seconds": hbm_s + gather_s + small_s,
            "hlo_hbm_bytes": cost.hbm_bytes,
            "hlo_collective_bytes": dict(cost.collective_bytes), "hlo_wire_bytes": dict(cost.collective_wire_bytes),
            "hlo_small_collectives": small, "compiled_seconds": compiled_s, "hlo_warnings": cost.warnings}


def count_collectives(walker, comp: str, below: int, times: int = 1) -> int:
    """Executions of collectives moving fewer than `below` bytes (latency-bound), loops by their trip counts."""
    count = 0
    for ins in walker.comps.get(comp, []):
        if ins.op == "while":
            trips = walker.trip_count(comp, ins, cost_lib.Cost())
            count += count_collectives(walker, ins.attr("body"), below, times * trips)
        elif ins.op in ("call", "async-start"):
            count += count_collectives(walker, ins.attr("to_apply") or ins.attr("calls"), below, times)
        elif any(ins.op in (k, k + "-start") for k in cost_lib.COLLECTIVES):
            count += times * (walker.collective_size(comp, ins) < below)
    return count


def ruler_case_seconds(row, tokens: int, key: str = "seconds") -> float:
    return row["prefill_estimate"]["step_seconds"] + tokens * row["decode_estimate"][key]


def gate_costs(stages, rows, budget) -> list[dict]:
    """Each gate's RULER cases x the estimated seconds per case, from the rows compiled for its stage and lengths."""
    out = []
    for st in stages:
        g = st.gate
        if g is None or not g.ruler:
            continue
        parts, missing = [], []
        for n in g.ruler_lengths:
            row = next((r for r in rows if r["length"] == n and r["stage"] == st.name and "decode" in r), None)
            if row is None:
                missing.append(n)
                continue
            for t in g.ruler_tasks:
                tok = TOKENS_TO_GENERATE[TASKS[t].family]
                parts.append({"length": n, "task": t, "cases": g.ruler_cases, "tokens": tok,
                              "seconds_per_case": ruler_case_seconds(row, tok),
                              "seconds_per_case_compiled": ruler_case_seconds(row, tok, "compiled_seconds"),
                              "fits": max(row["prefill"]["total"], row["decode"]["total"]) <= budget,
                              "prefill_seconds": row["prefill_estimate"]["step_seconds"]})
        out.append({"stage": st.name, "lengths": g.ruler_lengths, "tasks": g.ruler_tasks, "cases": g.ruler_cases,
                    "parts": parts, "missing": missing,
                    "seconds": sum(p["cases"] * p["seconds_per_case"] for p in parts),
                    "seconds_compiled": sum(p["cases"] * p["seconds_per_case_compiled"] for p in parts),
                    "lengths_over_budget": sorted({p["length"] for p in parts if not p["fits"]}),
                    "prefill_only_seconds": sum(p["cases"] * p["prefill_seconds"] for p in parts)})
    return out


def gib(x) -> str:
    return f"{x / GiB:.1f}"


def table(rows, budget) -> str:
    lines = ["| prompt | stage: setup | prefill peak / total, fits | decode peak / total, fits "
             "| cache (shapes / compile) | est. ms/token, model: HBM + gather + 2/layer "
             "| est. ms/token as compiled: HLO HBM GB, small collectives "
             "| est. prefill (s) | est. RULER niah case (s): model / as compiled |",
             "|---:|---|---|---|---|---|---|---:|---|"]
    ok = lambda t: "yes" if t <= budget else "**no**"  # noqa: E731
    for r in rows:
        cells = [f"{r['length']:,}", f"{r['stage']}: {r['setup']}"]
        if "prefill_error" in r:
            lines.append("| " + " | ".join(cells + [f"compile failed: {r['prefill_error'][:300]}"] + [""] * 6) + " |")
            continue
        pf, c = r["prefill"], r["cache"]
        cells.append(f"{gib(pf['peak'])} / {gib(pf['total'])}, {ok(pf['total'])}")
        if "decode" not in r:
            cells += [f"compile failed: {r.get('decode_error', '')[:300]}", f"{gib(c['total'])} / -", "", "",
                      f"{r['prefill_estimate']['step_seconds']:,.1f}", ""]
        else:
            d, e = r["decode"], r["decode_estimate"]
            compiled_cache = d["argument"] - r["params_bytes"]  # the decode step's arguments: params + cache (+ bytes)
            cells += [f"{gib(d['peak'])} / {gib(d['total'])}, {ok(d['total'])}",
                      f"{gib(c['total'])} / {gib(compiled_cache)}",
                      f"{1e3 * e['seconds']:.1f} = {1e3 * e['hbm_seconds']:.1f} + {1e3 * e['gather_seconds']:.1f} + "
                      f"{1e3 * e['small_collective_seconds']:.2f}",
                      f"{1e3 * e['compiled_seconds']:.1f} ({e['hlo_hbm_bytes'] / 1e9:.0f} GB, "
                      f"{e['hlo_small_collectives']})",
                      f"{r['prefill_estimate']['step_seconds']:,.1f}",
                      f"{ruler_case_seconds(r, 128):,.1f} / {ruler_case_seconds(r, 128, 'compiled_seconds'):,.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="h100")
    ap.add_argument("--recipe", default="configs/recipes/llama3_1_8b_4m.yaml")
    ap.add_argument("--lengths", default="131072,1048576,1048576:4m,4194304",
                    help="prompt lengths, each LENGTH or LENGTH:STAGE (default stage: the first long enough)")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--param-dtype", default="bfloat16")
    ap.add_argument("--collective-latency", type=float, default=10e-6, help="seconds per pmax/psum (assumed)")
    ap.add_argument("--out", default=None, help="directory for the Markdown table and the JSON of every number")
    ap.add_argument("overrides", nargs="*", help="key=value applied to every stage (e.g. tiling.mlp=true)")
    args = ap.parse_args(argv)
    target = parse_target(args.target)
    base = load_config(args.recipe, [f"mesh.num_devices={target.devices}"])
    stages = expand(base)
    devices = compile_only_devices(target)
    budget = target.device_memory
    print(f"{base.model.name} on {target.describe()}, budget {gib(budget)} GiB per device; {machine()}; "
          f"jax {jax.__version__}; commit {commit()}", flush=True)
    rows = []
    with xla_log.collecting() as log:
        for item in args.lengths.split(","):
            length, _, stage = item.partition(":")
            t0 = time.perf_counter()
            row = run_case(int(length), stage or None, stages, target, devices, args)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k in ("length", "stage", "prefill", "decode", "cache",
                                                                    "prefill_error", "decode_error", "seconds")},
                             default=str), flush=True)
    gates = gate_costs(stages, rows, budget)
    text = table(rows, budget)
    text += "\n\n" + "\n".join(
        f"- gate of stage {g['stage']} (RULER {', '.join(g['tasks'])} at {', '.join(f'{n:,}' for n in g['lengths'])}, "
        f"{g['cases']} cases each): {sum(p['cases'] for p in g['parts'])} cases, est. {g['seconds'] / 60:,.1f} min "
        f"generating by the model, {g['seconds_compiled'] / 60:,.1f} as compiled "
        f"({g['prefill_only_seconds'] / 60:,.1f} min of it prefill)"
        + (f"; over the memory budget at {g['lengths_over_budget']}" if g["lengths_over_budget"] else "")
        + (f"; lengths not compiled: {g['missing']}" if g["missing"] else "") for g in gates)
    print(text)
    for line in log.summary():
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, f"generation_scale_{base.model.name}_{args.target.replace(':', '-')}")
        with open(stem + ".md", "w") as f:
            command = " ".join(sys.argv[1:] if argv is None else argv)
            f.write(f"command: python experiments/generation_scale.py {command}\n\n"
                    f"{machine()}, jax {jax.__version__}, commit {commit()}\n\n{text}\n")
        with open(stem + ".json", "w") as f:
            json.dump({"rows": rows, "gates": gates, "budget": budget, "target": args.target}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

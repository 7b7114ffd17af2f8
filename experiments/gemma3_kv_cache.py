"""KV-cache bytes per device of Gemma 3 12B (`configs/gemma3_12b.yaml`: 48 layers, 40 with a sliding window of 1024
positions, 8 KV heads of 256, bfloat16) generating on 8 devices (8-way Ulysses), against the same model with every
layer global (`model.sliding_window=0`, which is also what every layer cached before the window layers kept only
their window).

The bytes come from the cache's shapes and shardings as the code makes them, nothing allocated:
`jaxlong.generation.decode.cache_shapes` (the decode step's cache), checked against `jax.eval_shape` of the prefill
program itself (`make_prefill`, abstract parameters and batch: the shapes it returns), each field's shard shape
under its sharding (`cache_bytes`); and the chunked prefill's stacks while its chunks run
(`ChunkedPrefill.stacks`: the global layers' whole prompt, the window layers' chunks that a window reaches) with the
window buffers it fills as rows end.

    python experiments/gemma3_kv_cache.py --out experiments/results/gemma3_kv_cache.md

Prints a Markdown table and writes it with the command and the machine to `--out`. CPU only (8 simulated devices):
shapes, not a measurement of device memory.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import load_config  # noqa: E402
from jaxlong.core.mesh import BATCH_AXES, SEQ_AXES, build_mesh  # noqa: E402
from jaxlong.generation.chunked import ChunkedPrefill  # noqa: E402
from jaxlong.generation.decode import cache_bytes, cache_shapes, make_prefill  # noqa: E402
from jaxlong.training.step import abstract_params  # noqa: E402

CONFIG = "configs/gemma3_12b.yaml"
GIB = 2**30


def measure(prompt: int, max_new: int, windows: bool, chunk: int, check: bool) -> dict:
    """Per-device bytes of the cache of one row of `prompt` tokens with room for `max_new` new ones, with the config's
    windows or all-global, and of the chunked prefill's stacks (chunks of `chunk`); `check`: compare `cache_shapes`
    with the prefill program's own output shapes and dtypes (`jax.eval_shape`, a trace of the 12B model)."""
    overrides = [f"seq_len={prompt}"] + ([] if windows else ["model.sliding_window=0"])
    cfg = load_config(CONFIG, overrides)
    mesh = build_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    cache = cache_shapes(cfg, mesh, 1, prompt, max_new)
    if check:
        params = abstract_params(cfg, mesh)
        sh = NamedSharding(mesh, P(BATCH_AXES, SEQ_AXES))
        batch = {k: jax.ShapeDtypeStruct((1, prompt), jnp.int32, sharding=sh)
                 for k in ("inputs", "positions", "segment_ids")}
        _, out = jax.eval_shape(make_prefill(cfg, mesh, max_new), params, batch)
        got, want = [(a.shape, a.dtype) for a in out], [(a.shape, a.dtype) for a in cache]
        if got != want:
            raise AssertionError(f"the prefill returns {got}, cache_shapes says {want}")
    f = cache_bytes(cache)
    stacks = ChunkedPrefill(cfg, mesh, chunk, max_new).stacks(1, prompt)
    return {"prompt": prompt, "windows": windows, "global_kv": f["k"] + f["v"], "new_kv": f["new_k"] + f["new_v"],
            "window_kv": f["win_k"] + f["win_v"], "valid": f["valid"], "total": sum(f.values()),
            "chunked": sum(_shard(a) for a in stacks) + f["win_k"] + f["win_v"], "global_layers": cache.k.shape[0],
            "local_layers": cache.win_k.shape[0], "window": cfg.model.sliding_window}


def _shard(a) -> int:
    """Bytes of one device's shard of the abstract array `a`."""
    n = 1
    for d in a.sharding.shard_shape(a.shape):
        n *= d
    return n * jnp.dtype(a.dtype).itemsize


def table(rows: list[dict]) -> str:
    """The Markdown table of `measure`'s rows, GiB per device."""
    g = lambda b: f"{b / GIB:,.3f}"  # noqa: E731
    lines = ["| prompt tokens | layers (global + window) | global layers' prompt K/V | generated K/V (global) | "
             "window buffers | valid | **decode cache** | chunked prefill's stacks and window buffers |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kinds = (f"{r['global_layers']} + {r['local_layers']} (W={r['window']})" if r["windows"] else
                 f"{r['global_layers']} + 0 (all global)")
        lines.append(f"| {r['prompt']:,} | {kinds} | {g(r['global_kv'])} | {g(r['new_kv'])} | {g(r['window_kv'])} | "
                     f"{g(r['valid'])} | **{g(r['total'])}** | {g(r['chunked'])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="131072,1048576", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--max-new", type=int, default=1024, help="room for generated tokens")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill_chunk of the chunked prefill's row")
    ap.add_argument("--no-check", action="store_true", help="skip the prefill program's trace")
    ap.add_argument("--out", help="write the table with the command and the machine here")
    args = ap.parse_args(argv)
    rows = [measure(int(n), args.max_new, w, args.chunk, not args.no_check)
            for n in args.prompts.split(",") for w in (True, False)]
    text = table(rows)
    print(text)
    if args.out:
        doc = __doc__.split("\n\n    python")[0]
        cmd = "python experiments/gemma3_kv_cache.py " + " ".join(sys.argv[1:] if argv is None else argv)
        with open(args.out, "w") as f:
            f.write(f"# Gemma 3 12B: KV-cache bytes per device, window layers against all-global\n\n{doc}\n\n"
                    f"One row (batch 1), room for {args.max_new} generated tokens, GiB (2^30 bytes) per device of 8 "
                    f"(mesh context 8), bfloat16; the chunked prefill in chunks of {args.chunk} tokens."
                    f"\n\n{text}\n\nCommand: `{cmd.strip()}`. Machine: {machine()} (computed from shapes, no GPU); "
                    f"commit {commit()}.\n")


if __name__ == "__main__":
    main()

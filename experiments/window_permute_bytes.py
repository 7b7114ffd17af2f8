"""A sliding-window layer under ring attention sends its halo, not the shards: the collective-permute bytes of the
compiled program (forward and backward) of a local layer's attention under ring x Ulysses, against a global
layer's, counted from the optimized HLO (each `collective-permute` op's result, once per op as it appears in the
program). The local layer's 8 permutes (the K and V tails of its two half-chunks forward, their gradients backward)
run once; the global layer's ring steps sit in loops that run R - 1 times, which this count does not multiply, so
a global layer moves at least R - 1 times the bytes shown.

    python experiments/window_permute_bytes.py --out experiments/results/window_permute_bytes.md

Prints a Markdown table (sequence, ring, window, halo rows, bytes of a local layer, bytes of a global layer, ratio)
and writes it with the command and the machine to `--out`. Compiled on the CPU (8 simulated devices): the program,
not a measurement of a network.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxlong.parallel.halo import exchange_bytes, halo_rows  # noqa: E402
from jaxlong.parallel.ulysses import ulysses_attention  # noqa: E402

BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4}


def collective_bytes(seq: int, ring: int, context: int, window: int, *, heads: int = 4, kv_heads: int = 1,
                     head_dim: int = 64, block: int = 128, exchange: str = "all_to_all") -> dict[str, int]:
    """Bytes of every `collective-permute` and `all-to-all` in the compiled forward and backward of one attention
    layer (f32, batch 1) under ring x Ulysses on 8 CPU devices, `window` 0 for a global layer; `exchange` the local
    layer's `attention.window_exchange` without ring."""
    mesh = jax.make_mesh((1, 8 // (ring * context), ring, context), ("data", "fsdp", "ring", "context"),
                         axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:8])
    spec = NamedSharding(mesh, P(("data", "fsdp"), ("ring", "context"), None, None))

    def loss(q, k, v):
        return jnp.sum(ulysses_attention(q, k, v, mesh=mesh, backend="blockwise", block_q=block, block_k=block,
                                         window=window, window_exchange=exchange))

    args = [jax.ShapeDtypeStruct((8 // (ring * context), seq, n, head_dim), jnp.float32, sharding=spec)
            for n in (heads, kv_heads, kv_heads)]
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()
    total = {"permute": 0, "all_to_all": 0}
    for line in text.splitlines():
        for kind, op in (("permute", "collective-permute"), ("all_to_all", "all-to-all")):
            if re.search(op + r"(-start)?\(", line):
                total[kind] += sum(int(np.prod([int(x) for x in dims.split(",") if x])) * BYTES[t]
                                   for t, dims in re.findall(r"([a-z0-9]+)\[([\d,]*)\]", line.split("=", 1)[1]
                                                             .split(op)[0]))
    return total


def permute_bytes(seq: int, ring: int, context: int, window: int, **kw) -> int:
    """The collective-permute bytes of `collective_bytes`."""
    return collective_bytes(seq, ring, context, window, **kw)["permute"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = ["| sequence | ring x context | window | halo rows | local layer | global layer | global / local |",
            "|---:|---|---:|---:|---:|---:|---:|"]
    for ring, context, window in ((4, 2, 128), (4, 2, 256), (2, 4, 128)):
        local, glob = permute_bytes(args.seq, ring, context, window), permute_bytes(args.seq, ring, context, 0)
        h = halo_rows(window, args.seq // (2 * ring), 128, 128)
        rows.append(f"| {args.seq} | {ring} x {context} | {window} | {h} | {local:,} B | {glob:,} B | "
                    f"{glob / local:.1f} |")
    rows += ["", "Without ring (Ulysses 8; 8 query heads, 2 KV heads), a local layer's window by the all-to-all or by the halo exchange over context "
             "(`attention.window_exchange`), and the bytes `exchange_bytes` counts for the forward (the rule `auto` "
             "follows):", "",
             "| sequence | context | window | exchange | all-to-all | collective-permute | counted (forward) |",
             "|---:|---:|---:|---|---:|---:|---:|"]
    for window in (128, 512):
        counted = exchange_bytes(window, args.seq, 8, 8, 2, 64, 4, 128, 128)
        for exchange, n in (("all_to_all", counted[1]), ("halo", counted[0])):
            got = collective_bytes(args.seq, 1, 8, window, heads=8, kv_heads=2, exchange=exchange)
            rows.append(f"| {args.seq} | 8 | {window} | {exchange} | {got['all_to_all']:,} B | {got['permute']:,} B | "
                        f"{n:,} B |")
    table = "\n".join(rows)
    print(table)
    if args.out:
        from experiments.provenance import machine  # noqa: PLC0415

        with open(args.out, "w") as f:
            f.write(f"# Collective-permute bytes of a local layer against a global one under ring\n\n{__doc__}\n"
                    f"{table}\n\nCommand: `python experiments/window_permute_bytes.py --seq {args.seq} --out "
                    f"{args.out}`. Machine: {machine()}.\n")


if __name__ == "__main__":
    main()

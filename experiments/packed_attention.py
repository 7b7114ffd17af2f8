"""Packed documents against one long causal sequence: speed and compiled memory of blockwise attention.

A sequence of S tokens holding n documents of equal length S/n (segment ids 1..n) against the same S tokens as
one causal sequence (no segment ids), forward + backward (`jax.value_and_grad` of the blockwise kernel) on the
CPU. With document masking the kernel skips every tile pair of two different documents, so it visits about
n * (S/n / block)^2 / 2 tiles instead of (S / block)^2 / 2: 1/n of the work (plus the diagonal tiles).

    python experiments/packed_attention.py                       # S = 16384, 16 documents, block 512
    python experiments/packed_attention.py --seq 32768 --docs 16 --out experiments/results/packed_attention.md

Prints a Markdown table (time per forward+backward, speed-up, compiled temporaries of both programs) and writes
it with the command and the machine to `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.provenance import machine  # noqa: E402
from jaxlong.core.memstats import compiled_bytes
from jaxlong.core.units import fmt_bytes
from jaxlong.kernels.blockwise import blockwise_attention


def measure(seq: int, docs: int, heads: int, kv_heads: int, head_dim: int, block: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, seq, heads, head_dim), np.float32))
    k = jnp.asarray(rng.standard_normal((1, seq, kv_heads, head_dim), np.float32))
    v = jnp.asarray(rng.standard_normal((1, seq, kv_heads, head_dim), np.float32))
    seg = jnp.asarray(np.repeat(np.arange(1, docs + 1, dtype=np.int32), seq // docs)[None])

    def loss(q, k, v, seg):
        return jnp.sum(blockwise_attention(q, k, v, block_q=block, block_k=block, segment_ids=seg) ** 2)

    def loss_causal(q, k, v, seg):
        del seg
        return jnp.sum(blockwise_attention(q, k, v, block_q=block, block_k=block) ** 2)

    out = {}
    for name, fn in (("causal", loss_causal), ("packed", loss)):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2))).lower(q, k, v, seg).compile()
        jax.block_until_ready(compiled(q, k, v, seg))  # warm-up
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, seg))
            times.append(time.perf_counter() - t0)
        out[name] = {"time_s": float(np.median(times)), "temp": compiled_bytes(compiled)["temp"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3, help="timed runs per program (the median is reported)")
    ap.add_argument("--out", default=None, help="Markdown file to write the result to")
    a = ap.parse_args(argv)
    if a.seq % a.docs or (a.seq // a.docs) % a.block and a.block % (a.seq // a.docs):
        ap.error("--seq must split into --docs equal documents aligned with --block")
    r = measure(a.seq, a.docs, a.heads, a.kv_heads, a.head_dim, a.block, a.reps)
    c, p = r["causal"], r["packed"]
    table = "\n".join([
        "| attention | forward + backward (s, median of %d) | compiled temporaries |" % a.reps,
        "|---|---|---|",
        f"| full causal, 1 sequence of {a.seq} | {c['time_s']:.3f} | {fmt_bytes(c['temp'])} |",
        f"| {a.docs} packed documents of {a.seq // a.docs} (segment ids) | {p['time_s']:.3f} | {fmt_bytes(p['temp'])} |",
        "",
        f"Speed-up of the packed sequence: **{c['time_s'] / p['time_s']:.1f}x**; compiled temporaries packed / "
        f"causal: {p['temp'] / c['temp']:.3f}.",
    ])
    print(table)
    if a.out:
        cmd = "python " + " ".join([os.path.relpath(sys.argv[0])] + (argv if argv is not None else sys.argv[1:]))
        with open(a.out, "w") as f:
            f.write(f"# Packed documents vs one causal sequence (blockwise attention, CPU)\n\n"
                    f"Blockwise attention (`jaxlong.kernels.blockwise.blockwise_attention`), forward + backward "
                    f"(`jax.value_and_grad`), float32, batch 1, {a.heads} query heads, {a.kv_heads} KV heads, head_dim "
                    f"{a.head_dim}, tiles {a.block} x {a.block}. The packed run passes segment ids of {a.docs} equal "
                    f"documents; the kernel skips the tiles between different documents. Times are the median of "
                    f"{a.reps} runs after a warm-up, from one invocation; the machine was shared with other jobs, so "
                    f"absolute times are noisy, the ratio less so.\n\n"
                    f"Command: `{cmd}`\n\nMachine: {machine()}, jax {jax.__version__}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

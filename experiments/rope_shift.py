"""What a user sees of RoPE's numerics at long positions: a window's logits should not depend on where the window
sits, since RoPE attention depends only on the distance between query and key. Shift every position of a
512-token window by the same offset and compare the logits with those of the unshifted window: the largest
change and the share of tokens whose argmax (the greedy next token) stays the same, with jaxlong's exact angles
(`jaxlong.layers.blocks.rope_angles`) and with the float32 product `float32(position) * inv_freq` that
jaxlong used before and transformers uses (monkeypatched in for the comparison).

A small float32 model (head_dim 64, theta 500,000, blockwise kernel, one device, random weights with
`model.init_std=0.1`, random tokens). Writes `<out>.md` (command, machine, config, the table).

  JAX_PLATFORMS=cpu python experiments/rope_shift.py          # experiments/results/rope_shift.md
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from provenance import commit, machine  # noqa: E402

from jaxlong.config import load_config  # noqa: E402
from jaxlong.core.mesh import build_mesh  # noqa: E402
from jaxlong.layers import blocks  # noqa: E402
from jaxlong.config import runtime  # noqa: PLC0415
from jaxlong.models.llama import forward, init_params, model_graphdef  # noqa: PLC0415

MODEL = ["model.vocab_size=512", "model.hidden=256", "model.layers=4", "model.heads=4", "model.kv_heads=4",
         "model.head_dim=64", "model.mlp_hidden=512", "model.rope_theta=500000", "model.init_std=0.1",
         "seq_len=512", "global_batch=1", "attention.backend=blockwise", "attention.block_q=128",
         "attention.block_k=128", "param_dtype=float32", "compute_dtype=float32",
         "mesh.data=1", "mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1"]
OFFSETS = (131_072, 1_048_576, 4_194_304, 10_485_760, 20_971_520, 2**25 - 512)
EXACT = blocks.rope_angles


def float32_product(positions, inv_freq):
    """The angle as transformers (and jaxlong before) forms it: `float32(position) * float32(inv_freq)`."""
    return positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)


def measure(extra: list[str], seed: int) -> list[tuple]:
    cfg = load_config(None, [*MODEL, *extra])
    mesh = build_mesh(cfg.mesh, devices=jax.devices()[:1])
    params = init_params(cfg.model, mesh, cfg.seed, cfg.param_dtype)
    rt, graphdef = runtime(cfg, mesh), model_graphdef(cfg.model, cfg.param_dtype)
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, cfg.model.vocab_size, (1, cfg.seq_len)), jnp.int32)
    rows = []
    for name, angles in (("float32 product (before)", float32_product), ("exact (now)", EXACT)):
        blocks.rope_angles = angles  # traced anew: a fresh jit per formula

        @jax.jit
        def logits(p, pos):
            hidden, head = forward(graphdef, p, tokens, rt, pos, None)
            return jnp.einsum("bsh,hv->bsv", hidden, head)

        base = np.arange(cfg.seq_len, dtype=np.int32)[None]
        ref = np.asarray(logits(params, base))
        for off in OFFSETS:
            out = np.asarray(logits(params, base + np.int32(off)))
            agree = float((out.argmax(-1) == ref.argmax(-1)).mean())
            rows.append((name, off, float(np.abs(out - ref).max()), agree, float(np.abs(ref).max())))
    blocks.rope_angles = EXACT
    return rows


def table_gap(ends=(64, 8192, 131_072, 1_048_576, 4_194_304, 10_485_760, 20_971_520)) -> list[str]:
    """Llama-3.1-8B's tables (head_dim 128, theta 500,000, llama3 scaling): jaxlong's against transformers'
    float32 formula (`cos(float32(p) * inv_freq)` in float32), over the 4,096 positions before each end."""
    cfg = load_config(str(ROOT / "configs/llama3_1_8b.yaml"), [])
    inv, _ = blocks.rope_frequencies(128, cfg.model.rope_theta, cfg.model.rope_scaling)
    out = ["| positions | max angle gap (rad) | max \\|Δcos\\|, \\|Δsin\\| | pairs off by > 0.01 | exact vs float64 |",
           "|---|---:|---:|---:|---:|"]
    tables = jax.jit(lambda p: blocks.rope_tables(p, 128, cfg.model.rope_theta, cfg.model.rope_scaling))
    for end in ends:
        pos = np.arange(max(end - 4096, 0), end, dtype=np.int32)
        cos, sin = (np.asarray(t, np.float64) for t in tables(pos))
        hf = (pos.astype(np.float32)[:, None] * inv).astype(np.float32)  # transformers' angle
        hf_cos, hf_sin = np.cos(hf).astype(np.float64), np.sin(hf).astype(np.float64)
        exact = pos.astype(np.float64)[:, None] * inv.astype(np.float64)
        gap = np.abs(np.angle(np.exp(1j * (hf.astype(np.float64) - exact))))
        dtab = max(np.abs(cos - hf_cos).max(), np.abs(sin - hf_sin).max())
        err = max(np.abs(cos - np.cos(exact)).max(), np.abs(sin - np.sin(exact)).max())
        out.append(f"| {max(end - 4096, 0):,} to {end - 1:,} | {gap.max():.2g} | {dtab:.2g} | "
                   f"{int((gap.max(axis=0) > 0.01).sum())} of 64 | {err:.1g} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "experiments/results/rope_shift"))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lines = ["# RoPE at long positions: logits of a shifted window (float32 product vs exact angles)", "",
             f"Machine: {machine()}; commit {commit()}. Command:", "", "```bash",
             "JAX_PLATFORMS=cpu python experiments/rope_shift.py " + shlex.join(sys.argv[1:]), "```", "",
             "A 512-token window of random tokens through a random float32 model (`" + " ".join(MODEL) + "`), "
             "one device, blockwise kernel; the same window with every position + offset. *max |Δ logit|*: the "
             "largest change of any logit (the unshifted logits reach the value in the last column); *argmax "
             "agrees*: share of the 512 tokens whose greedy next token is unchanged. RoPE attention depends only "
             "on distances, so both should be 0 and 100% up to float32 rounding.", ""]
    for title, extra in (("plain RoPE", []), ("llama3 scaling (factor 8, original 8192)",
                                               ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8",
                                                "model.rope_scaling.original_max_position_embeddings=8192"])):
        rows = measure(extra, args.seed)
        lines += [f"## {title}", "", "| angles | offset | max \\|Δ logit\\| | argmax agrees | max \\|logit\\| |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {n} | {off:,} | {d:.3g} | {a:.1%} | {m:.2f} |" for n, off, d, a, m in rows]
        lines.append("")
        print("\n".join(lines[-len(rows) - 3:]), flush=True)
    lines += ["## Llama-3.1-8B's tables against transformers' float32 formula", "",
              "jaxlong's cos/sin tables (exact angles) against transformers' `cos(float32(position) * inv_freq)` "
              "in float32, Llama-3.1-8B's frequencies (head_dim 128, theta 500,000, llama3 scaling), over the "
              "4,096 positions before each end; *angle gap*: transformers' float32 angle minus the exact angle, "
              "modulo 2π; last column: jaxlong's tables against float64.", "", *table_gap(), ""]
    print("\n".join(lines[-12:]), flush=True)
    Path(args.out + ".md").write_text("\n".join(lines))
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()

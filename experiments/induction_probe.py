"""Does a tiny Llama learn to copy by content? Train it on documents that are one random string repeated to fill the
window (36 characters: digits and lowercase letters, byte-level) and score the held-out argmax on the repeats.

With `--min-period == --max-period` every row repeats at the same offset, which a head at a fixed relative position
solves; with a range, the offset changes from row to row and only content-based copying (an induction head: attend
to the token after the earlier occurrence of the current one) solves it. That copy is what every RULER
needle-in-a-haystack answer needs, so this probe says how many steps the model of `experiments/ruler_demo.py` needs
before it can copy at all (experiments/results/ruler_demo.md).

    python experiments/induction_probe.py --min-period 20 --max-period 20 --steps 100     # fixed offset
    python experiments/induction_probe.py --min-period 10 --max-period 39 --steps 1500     # content-based
    python experiments/induction_probe.py --min-period 10 --max-period 39 model.init_std=0.09 optim.weight_decay=0

Prints the training loss and the fraction of the held-out repeats' targets whose argmax is right, every
`--every` steps. The loss is on the repeats only (the first period of each row is random, so unpredictable).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

MODEL = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.kv_heads=4", "model.head_dim=32",
         "model.mlp_hidden=384", "model.vocab_size=257", "model.rope_theta=10000"]
ALPHABET = np.frombuffer(b"0123456789abcdefghijklmnopqrstuvwxyz", np.uint8)


def periodic_batch(rng, length: int, rows: int, lo: int, hi: int) -> dict:
    """Host batch `[rows, length]`: BOS, then one random string of `lo`-`hi` characters (drawn per row) repeated;
    loss mask 1 on the targets after the first `2 * hi` tokens (every one a copy), 0 before."""
    tokens = []
    for _ in range(rows):
        period = rng.choice(ALPHABET, size=int(rng.integers(lo, hi + 1)))
        tokens.append(np.concatenate([[256], np.tile(period, length // len(period) + 2)[:length]]))
    t = np.array(tokens, np.int32)
    mask = np.ones((rows, length), np.float32)
    mask[:, :2 * hi] = 0
    return {"inputs": t[:, :length], "targets": t[:, 1:length + 1], "mask": mask,
            "positions": np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
            "segment_ids": np.ones((rows, length), np.int32)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3, help="constant after 20 warmup steps")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--min-period", type=int, default=10)
    p.add_argument("--max-period", type=int, default=39)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("overrides", nargs="*", help="extra config key=value after the model's")
    args = p.parse_args(argv)
    if not 1 <= args.min_period <= args.max_period or 2 * args.max_period >= args.seq_len:
        p.error(f"--min-period {args.min_period} / --max-period {args.max_period}: need 1 <= min <= max and "
                f"2 x max < --seq-len {args.seq_len}")

    import jax  # noqa: PLC0415

    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.evaluation import token_stats  # noqa: PLC0415
    from jaxlong.core.batch import put_batch  # noqa: PLC0415
    from jaxlong.training import step as step_lib  # noqa: PLC0415

    cfg = load_config(None, [*MODEL, f"seq_len={args.seq_len}", f"global_batch={args.batch}", f"steps={args.steps}",
                             f"optim.lr={args.lr}", "optim.warmup_steps=20", "optim.min_lr_ratio=1.0",
                             "mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", *args.overrides])
    mesh = build_mesh(cfg.mesh)
    state, train_step = step_lib.init_state(cfg, mesh), step_lib.compile_train_step(cfg, mesh)
    stats = token_stats(cfg, mesh)
    rng = np.random.default_rng(0)
    held = periodic_batch(np.random.default_rng(9), args.seq_len, args.batch, args.min_period, args.max_period)
    scored = held["mask"] > 0
    t0 = time.time()
    for i in range(1, args.steps + 1):
        batch = periodic_batch(rng, args.seq_len, args.batch, args.min_period, args.max_period)
        state, metrics = jax.block_until_ready(train_step(state, put_batch(batch, mesh)))
        if i % args.every == 0 or i == args.steps:
            argmax = stats(state["params"], held)[1]
            right = float(np.mean(argmax[scored] == held["targets"][scored]))
            print(f"step {i}: loss {float(metrics['loss']):.3f}, copies right {right:.2f} ({time.time() - t0:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()

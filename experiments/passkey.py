"""Does context-parallel training learn to use its context? Train a tiny Llama from scratch on passkey documents
mixed with the corpus, at 8K tokens over 8 simulated devices (Ulysses context parallelism), and measure passkey
retrieval by needle depth as training goes.

Each step's global batch holds `--passkey-rows` passkey sequences (`jaxlong.evaluate.passkey_example`: a
periodic filler text, a needle "The pass key is KEY. ..." at a uniformly random depth, the question and the
answer at the end) and the rest corpus windows (the Python standard library, byte-level). The loss is the usual
mean over all tokens; the answer tokens of passkey rows are weighted `--answer-weight` (a mask weight).
Every `--eval-every` steps retrieval is scored teacher-forced (`jaxlong.evaluate.score_passkey`) on held-out keys
at `--depths`; training stops at `--minutes` or once every depth reaches `--target` twice in a row.

Writes `<out>.md` (command, machine, config, the table), `<out>.csv` (accuracy per depth per evaluation) and
`<out>.png` (the accuracy curve over steps and the final accuracy by depth).

  python experiments/passkey.py                                # 8K tokens, context 4, 30 minutes at most
  python experiments/passkey.py --context 8 --minutes 20 --out experiments/results/passkey_c8
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ("model.hidden=128", "model.layers=2", "model.heads=4", "model.kv_heads=4", "model.head_dim=32",
         "model.mlp_hidden=384", "model.vocab_size=257")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--context", type=int, default=4, help="Ulysses degree (FSDP takes the other devices)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--short-seq", type=int, default=1024, help="first phase's length (0: train at --seq only)")
    p.add_argument("--short-batch", type=int, default=4)
    p.add_argument("--short-minutes", type=float, default=20.0, help="first phase's budget (CPU minutes / 2)")
    p.add_argument("--corpus-every", type=int, default=4, help="every N-th step is a batch of corpus windows")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--answer-weight", type=float, default=20.0)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--max-steps", type=int, default=1000, help="cosine schedule length and step cap per phase")
    p.add_argument("--minutes", type=float, default=10.0, help="full-length phase's budget in CPU minutes / 2")
    p.add_argument("--short-wall-minutes", type=float, default=30.0, help="first phase's wall-clock budget")
    p.add_argument("--wall-minutes", type=float, default=15.0, help="full-length phase's wall-clock budget")
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-per-depth", type=int, default=2)
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="depths scored during training")
    p.add_argument("--final-depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    p.add_argument("--final-per-depth", type=int, default=4)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "experiments/results/passkey"))
    p.add_argument("overrides", nargs="*", help="extra config key=value (after the small model: " + " ".join(MODEL) + ")")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import jax  # noqa: PLC0415 (after XLA_FLAGS)
    import numpy as np  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415

    from jaxlong import data as data_lib  # noqa: PLC0415
    from jaxlong import evaluate as ev  # noqa: PLC0415
    from jaxlong import step as step_lib  # noqa: PLC0415
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.mesh import batch_spec, build_mesh  # noqa: PLC0415

    cfg = load_config(None, [
        *MODEL, f"seq_len={args.seq}", f"global_batch={args.batch}", f"mesh.context={args.context}", "mesh.fsdp=-1",
        f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", f"steps={args.max_steps}",
        "optim.min_lr_ratio=0.1", f"seed={args.seed}", "attention.block_q=512", "attention.block_k=512",
        *args.overrides])
    mesh = build_mesh(cfg.mesh)
    tok = data_lib.get_tokenizer("byte")
    rng = np.random.default_rng([cfg.seed, 7])
    sharding = NamedSharding(mesh, batch_spec())
    # Phases (seq_len, batch, budget in minutes of 2 cores): an optional short warm-up phase, then the full length.
    phases = ([(args.short_seq, args.short_batch, args.short_minutes, args.short_wall_minutes)] if args.short_seq
              else []) + [(cfg.seq_len, args.batch, args.minutes, args.wall_minutes)]
    depths = [float(d) for d in args.depths.split(",")]
    state = step_lib.init_state(cfg, mesh)
    history = []  # (step, seq_len, wall minutes, train loss, [accuracy per depth])
    start, cpu0 = time.perf_counter(), time.process_time()
    step = 0

    def score(stats, seq, batch, depths, per_depth, seed):
        def predict(b):
            return jax.device_get(stats(state["params"], data_lib.put_on_mesh(b, sharding))[1])

        return ev.score_passkey(predict, tok.encode, lengths=[seq], depths=depths, per_cell=per_depth,
                                batch_size=batch, digits=args.digits, seed=seed)[:, 0]

    for seq, batch_size, minutes_budget, wall_budget in phases:
        pcfg = dataclasses.replace(cfg, seq_len=seq, global_batch=batch_size)
        corpus_batches = data_lib.batch_iterator(dataclasses.replace(
            pcfg, data=dataclasses.replace(pcfg.data, max_tokens=4_000_000)), tok)
        t0 = time.perf_counter()
        train_step = step_lib.compile_train_step(pcfg, mesh)
        stats = ev.make_token_stats_step(pcfg, mesh)
        print(f"phase {seq} tokens x {batch_size}: compiled in {time.perf_counter() - t0:.1f} s; mesh "
              f"{dict(mesh.shape)}", flush=True)
        phase_cpu0, phase_t0 = time.process_time(), time.perf_counter()

        def train_batch(i):
            if args.corpus_every and i % args.corpus_every == 0:
                return next(corpus_batches)
            examples = [ev.passkey_example(tok.encode, seq, float(rng.random()), ev.random_key(rng, args.digits))
                        for _ in range(batch_size)]
            b = ev.passkey_batch(examples)
            b["mask"] = 1.0 + (args.answer_weight - 1.0) * b["mask"]  # every token; answers weighted
            return b

        hits, phase_steps = 0, 0
        while phase_steps < args.max_steps:
            state, m = train_step(state, data_lib.put_on_mesh(train_batch(step + 1), sharding))
            step += 1
            phase_steps += 1
            spent = (time.process_time() - phase_cpu0) / 120 > minutes_budget or \
                (time.perf_counter() - phase_t0) / 60 > wall_budget
            if step % args.eval_every == 0 or spent:
                loss = float(m["loss"])
                acc = score(stats, seq, batch_size, depths, args.eval_per_depth, 10_000 + step)
                minutes = (time.perf_counter() - start) / 60
                history.append((step, seq, minutes, loss, acc.tolist()))
                print(f"step {step} at {seq} tokens ({minutes:.1f} min wall, {(time.process_time() - cpu0) / 120:.1f} "
                      f"min of 2 cores): loss {loss:.3f}, passkey accuracy by depth "
                      f"{' '.join(f'{a:.2f}' for a in acc)} (mean {acc.mean():.2f})", flush=True)
                hits = hits + 1 if acc.min() >= args.target else 0
                if hits >= 2 or spent:
                    break
    minutes, cpu_minutes = (time.perf_counter() - start) / 60, (time.process_time() - cpu0) / 120
    final_depths = [float(d) for d in args.final_depths.split(",")]
    final = score(stats, cfg.seq_len, args.batch, final_depths, args.final_per_depth, 99_999)
    print(f"final ({step} steps, {minutes:.1f} min wall, {cpu_minutes:.1f} min of 2 cores): "
          f"{' '.join(f'{a:.2f}' for a in final)} (mean {final.mean():.3f})")
    write(args, cfg, depths, final_depths, history, final, step, minutes, cpu_minutes)


def write(args, cfg, depths, final_depths, history, final, steps, minutes, cpu_minutes):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seq_len", "minutes", "train_loss", *[f"depth_{d}" for d in depths], "mean"])
        for s, seq, mins, loss, acc in history:
            w.writerow([s, seq, f"{mins:.2f}", f"{loss:.4f}", *[f"{a:.3f}" for a in acc], f"{sum(acc) / len(acc):.3f}"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for seq in sorted({h[1] for h in history}):
        hs = [h for h in history if h[1] == seq]
        a1.plot([h[0] for h in hs], [sum(h[4]) / len(h[4]) for h in hs], "o-", label=f"mean over depths, {seq} tokens")
        a1.plot([h[0] for h in hs], [min(h[4]) for h in hs], "s--", label=f"worst depth, {seq} tokens")
    a1.set(xlabel="train step", ylabel="passkey retrieval accuracy", ylim=(-0.02, 1.02),
           title=f"{cfg.seq_len} tokens, context {args.context}")
    a1.axhline(args.target, color="gray", lw=0.8)
    a1.legend()
    a2.bar([f"{d:.1f}" for d in final_depths], final)
    a2.set(xlabel="needle depth (0 = start of the window)", ylabel="accuracy", ylim=(0, 1.02),
           title=f"after {steps} steps ({minutes:.0f} min wall)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    cmd = "python experiments/passkey.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        "# Passkey retrieval under context-parallel training from scratch",
        "",
        f"`{cmd}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared), 8 simulated CPU "
        f"devices; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        f"Model: {', '.join(MODEL + tuple(args.overrides))}; seq_len {cfg.seq_len}, mesh data x fsdp x context = "
        f"1 x {8 // args.context} x {args.context} (Ulysses), global batch {args.batch}"
        + (f" (first phase: {args.short_seq} tokens x {args.short_batch} for {args.short_minutes} min of 2 cores or "
            f"{args.short_wall_minutes} min wall)"
           if args.short_seq else "") + ": passkey sequences, "
        f"every {args.corpus_every}th step a batch of corpus windows (Python stdlib), AdamW lr {args.lr} (warmup {args.warmup}, cosine over "
        f"{args.max_steps}), {args.digits}-digit byte-level keys, answer weight {args.answer_weight}.",
        "",
        f"Final: {steps} steps in {minutes:.1f} min wall ({cpu_minutes:.1f} min of CPU time / 2 cores: the machine "
        f"was shared); teacher-forced retrieval (every answer byte the argmax) by depth, "
        f"{args.final_per_depth} new keys per depth:",
        "",
        "| depth | " + " | ".join(f"{d:.2f}" for d in final_depths) + " | mean |",
        "|---|" + "---|" * (len(final_depths) + 1),
        "| accuracy | " + " | ".join(f"{a:.2f}" for a in final) + f" | {sum(final) / len(final):.3f} |",
        "",
        "During training (accuracy per depth, " + f"{args.eval_per_depth} keys each):",
        "",
        "| step | seq_len | wall minutes | train loss | " + " | ".join(f"depth {d}" for d in depths) + " | mean |",
        "|---|---|---|---|" + "---|" * (len(depths) + 1),
        *[f"| {s} | {q} | {m:.1f} | {l:.3f} | " + " | ".join(f"{x:.2f}" for x in a) + f" | {sum(a) / len(a):.2f} |"
          for s, q, m, l, a in history],
        "",
        f"![curve]({out.with_suffix('.png').name})",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}, .csv, .png")


if __name__ == "__main__":
    main()

"""Does context-parallel training learn to use its context? Train a tiny Llama from scratch on passkey documents
mixed with the corpus over 8 simulated devices (Ulysses context parallelism), with a length curriculum that ends
at 8K tokens, and measure passkey retrieval by needle depth as training goes.

Each step's batch holds passkey sequences (`jaxlong.evaluation.probes.passkey_example`: a periodic filler text without
digits, a needle "The pass key is KEY. Remember it. KEY is the pass key." at a uniformly random depth, the question
and the answer at the end); every `--corpus-every`-th step is a batch of corpus windows instead (the Python
standard library, byte-level). The loss covers every token; the targets that copy the key from earlier in the
sequence (its repeat inside the needle and the answer) are weighted `--copy-weight` (a mask weight), since they
are the only tokens that need the context. The curriculum `--phases` (length, batch, budget in CPU minutes / 2
cores) trains short first, where retrieval (an induction circuit: find the key's digits, copy the next one) is
learned in a few hundred steps, then longer; a phase before the last ends once every depth reaches `--target`
`--patience` evaluations in a row. Every phase runs on the same 8-device mesh, so all training is context parallel.
Each phase is a run of the trainer (`jaxlong.training.loop.run`) on this script's batches (`batches=`), the next
resuming the previous one's checkpoint at its own length (`--work` holds the run); a hook scores retrieval and
ends a phase early (`jaxlong.training.hooks`).
Retrieval is scored teacher-forced (`jaxlong.evaluation.steps.score_passkey`) on held-out keys at `--depths` during
training and at `--final-depths` at the end.

Writes `<out>.md` (command, machine, config, the tables), `<out>.csv` (accuracy per depth per evaluation, then
the final row) and `<out>.png` (the accuracy curve over steps and the final accuracy by depth).

  python experiments/passkey.py                                  # 256 -> 1K -> 8K tokens, context 4
  python experiments/passkey.py --context 8 --out experiments/results/passkey_c8
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ("model.hidden=128", "model.layers=2", "model.heads=4", "model.kv_heads=4", "model.head_dim=32",
         "model.mlp_hidden=384", "model.vocab_size=257", "model.rope_theta=10000")


def parse_phases(text: str) -> list[tuple[int, int, float, float]]:
    """"SEQ:BATCH:MINUTES[:WALL],..." -> [(seq_len, global batch, budget in CPU minutes / 2 cores, wall-clock
    minutes cap or inf)]; the last is the full length."""
    phases = []
    for part in text.split(","):
        seq, batch, minutes, *wall = part.split(":")
        phases.append((int(seq), int(batch), float(minutes), float(wall[0]) if wall else float("inf")))
    return phases


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default="256:16:8:22,1024:4:3:8,8192:2:20:20",
                   help="curriculum SEQ:BATCH:MINUTES[:WALL],... (MINUTES = CPU minutes / 2 cores, WALL = a wall-clock "
                        "cap in minutes); the last phase is the full length, scored at the end")
    p.add_argument("--context", type=int, default=4, help="Ulysses degree (FSDP takes the other devices)")
    p.add_argument("--corpus-every", type=int, default=8,
                   help="every N-th step is a batch of corpus windows (0: passkey documents only)")
    p.add_argument("--digits", type=int, default=3, help="digits of the scored keys")
    p.add_argument("--train-digits", default="3-8",
                   help="digits of the training keys, a range LO-HI drawn uniformly per example (longer keys give "
                        "more copy targets per sequence)")
    p.add_argument("--copy-weight", type=float, default=30.0,
                   help="loss weight of the key's copies (the needle's repeat and the answer); other tokens 1")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-steps", type=int, default=3000, help="step cap per phase")
    p.add_argument("--wall-minutes", type=float, default=52.0, help="wall-clock cap of the whole run")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-per-depth", type=int, default=4)
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="depths scored during training")
    p.add_argument("--final-depths", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1")
    p.add_argument("--final-per-depth", type=int, default=4)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--patience", type=int, default=2,
                   help="a phase ends once every depth reaches --target this many evaluations in a row")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "experiments/results/passkey"))
    p.add_argument("--work", default="runs/passkey", help="the trainer's run directory (emptied first)")
    p.add_argument("overrides", nargs="*",
                   help="extra config key=value (after the small model: " + " ".join(MODEL) + ")")
    args = p.parse_args(argv)
    try:
        parse_phases(args.phases)
    except ValueError:
        p.error(f"--phases {args.phases}: give SEQ:BATCH:MINUTES[:WALL],... (e.g. 256:16:8:22,1024:4:3)")
    return args


def copy_weights(example, weight: float) -> np.ndarray:
    """float32 `[S]` loss weights of one passkey example: `weight` on the targets that copy the key from earlier
    in the sequence (its repeat inside the needle and the answer), 1 elsewhere. The key's first occurrence is
    random and so unpredictable; it keeps weight 1."""
    targets = example.tokens[1:]
    digit = np.flatnonzero((targets >= 48) & (targets <= 57))
    w = np.ones(targets.shape, np.float32)
    w[digit[len(example.key):]] = weight
    return w


def main(argv=None):
    args = parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    import shutil  # noqa: PLC0415

    from jaxlong import data as data_lib  # noqa: PLC0415
    from jaxlong import evaluation as ev  # noqa: PLC0415
    from jaxlong.config import load_config  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.training.hooks import Hook  # noqa: PLC0415
    from jaxlong.recipes import train as run  # noqa: PLC0415

    phases = parse_phases(args.phases)
    lo_digits, hi_digits = (int(x) for x in args.train_digits.split("-"))
    full_seq, full_batch = phases[-1][:2]
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    length = max(args.max_steps * len(phases), args.warmup)  # the schedule's (constant after warmup)
    cfg = load_config(None, [
        *MODEL, f"seq_len={full_seq}", f"global_batch={full_batch}", f"mesh.context={args.context}", "mesh.fsdp=-1",
        f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}", f"steps={args.max_steps * len(phases)}",
        f"optim.decay_steps={length}",
        "optim.min_lr_ratio=1.0", f"seed={args.seed}", f"run_dir={work}", "run_name=run", "eval_every=0",
        "log_every=1", f"checkpoint_every={length}", *args.overrides])
    mesh = build_mesh(cfg.mesh)
    tok = data_lib.get_tokenizer("byte")
    rng = np.random.default_rng([cfg.seed, 7])
    depths = [float(d) for d in args.depths.split(",")]
    history = []  # (step, seq_len, wall minutes, CPU minutes / 2, train loss, [accuracy per depth])
    start, cpu0 = time.perf_counter(), time.process_time()
    load = [os.getloadavg()[0]]
    step, end = 0, {}

    def score(stats, params, seq, batch, depths, per_depth, seed):
        """Key accuracy per depth (`score_passkey`) and, as a diagnostic, the fraction of answer digits right."""
        digit_hits = []

        def predict(b):
            argmax = stats(params, b)[1]
            digit_hits.append(np.mean(argmax[:, -args.digits:] == b["targets"][:, -args.digits:]))
            return argmax

        acc = ev.score_passkey(predict, tok.encode, lengths=[seq], depths=depths, per_cell=per_depth,
                               batch_size=batch, digits=args.digits, seed=seed)[:, 0]
        return acc, float(np.mean(digit_hits))

    # Each phase is a run of the trainer (`jaxlong.training.loop.run`) on this script's batches, the next
    # resuming the previous one's checkpoint at its own length; a hook scores and ends a phase early.
    for index, (seq, batch_size, minutes_budget, wall_budget) in enumerate(phases):
        pcfg = dataclasses.replace(cfg, seq_len=seq, global_batch=batch_size, steps=step + args.max_steps,
                                   attention=dataclasses.replace(cfg.attention, block_q=min(512, seq // args.context),
                                                                 block_k=min(512, seq // args.context)))
        corpus_batches = data_lib.batch_iterator(dataclasses.replace(
            pcfg, data=dataclasses.replace(pcfg.data, max_tokens=4_000_000)), tok) if args.corpus_every else None
        t0 = time.perf_counter()
        stats = ev.token_stats(pcfg, mesh)
        clock, hits = {}, [0]
        last = index == len(phases) - 1

        def train_batch(i, rows, seq=seq, batch_size=batch_size, corpus_batches=corpus_batches, clock=clock):
            """Step `i`'s batch, drawn in step order from one generator (a phase is not resumed mid-way)."""
            if not clock:  # the phase's budget counts from its first batch, after the compile
                clock.update(cpu=time.process_time(), wall=time.perf_counter())
                print(f"phase {seq} tokens x {batch_size}: training {clock['wall'] - t0:.1f} s after the phase began "
                      f"(compile, resume); mesh {dict(mesh.shape)}", flush=True)
            if args.corpus_every and i % args.corpus_every == 0:
                b = next(corpus_batches)
            else:
                examples = [ev.passkey_example(tok.encode, seq, float(rng.random()),
                                               ev.random_key(rng, int(rng.integers(lo_digits, hi_digits + 1))))
                            for _ in range(batch_size)]
                b = ev.passkey_batch(examples)
                b["mask"] = np.stack([copy_weights(e, args.copy_weight) for e in examples])
            return {k: v[rows] for k, v in b.items()}

        def evaluate(ctx, seq=seq, batch_size=batch_size, minutes_budget=minutes_budget, wall_budget=wall_budget,
                     stats=stats, clock=clock, hits=hits, last=last, pcfg=pcfg):
            now = time.perf_counter()
            spent = (time.process_time() - clock["cpu"]) / 120 > minutes_budget or \
                (now - clock["wall"]) / 60 > wall_budget or (now - start) / 60 > args.wall_minutes
            if ctx.step % args.eval_every == 0 or spent:
                loss = ctx.metrics["loss"]
                acc, digit_acc = score(stats, ctx.params, seq, batch_size, depths, args.eval_per_depth,
                                       10_000 + ctx.step)
                minutes, cpu_minutes = (time.perf_counter() - start) / 60, (time.process_time() - cpu0) / 120
                load.append(os.getloadavg()[0])
                history.append((ctx.step, seq, minutes, cpu_minutes, loss, acc.tolist(), digit_acc))
                print(f"step {ctx.step} at {seq} tokens ({minutes:.1f} min wall, {cpu_minutes:.1f} min of 2 cores, "
                      f"load {load[-1]:.1f}): loss {loss:.3f}, passkey accuracy by depth "
                      f"{' '.join(f'{a:.2f}' for a in acc)} (mean {acc.mean():.2f}; answer digits right "
                      f"{digit_acc:.2f})", flush=True)
                hits[0] = hits[0] + 1 if acc.min() >= args.target else 0
                if spent or (hits[0] >= args.patience and seq != full_seq):
                    ctx.request_stop("budget spent" if spent else f"every depth >= {args.target} {hits[0]} times")
            over = (time.perf_counter() - start) / 60 > args.wall_minutes
            if (ctx.stop_reason or ctx.step == pcfg.steps) and (last or over):  # the experiment ends here
                end["spent"] = ((time.perf_counter() - start) / 60, (time.process_time() - cpu0) / 120)
                end["final"] = score(stats, ctx.params, seq, batch_size, final_depths, args.final_per_depth, 99_999)
                end["seq"], end["over"] = seq, over

        final_depths = [float(d) for d in args.final_depths.split(",")]
        result = run(pcfg, resume=index > 0, allow_changes=True, batches=train_batch,
                     hooks=[Hook(evaluate, every=1, name="passkey")])
        step = result["step"]
        if end:
            break
    (minutes, cpu_minutes), (final, final_digits), seq = end["spent"], end["final"], end["seq"]
    total_minutes, total_cpu = (time.perf_counter() - start) / 60, (time.process_time() - cpu0) / 120
    print(f"final ({step} steps, {minutes:.1f} min wall, {cpu_minutes:.1f} min of 2 cores; with the final scoring "
          f"{total_minutes:.1f} / {total_cpu:.1f}): {' '.join(f'{a:.2f}' for a in final)} (mean {final.mean():.3f}; "
          f"answer digits right {final_digits:.3f})")
    write(args, cfg, phases, seq, depths, final_depths, history, final, final_digits, step, (minutes, cpu_minutes),
          (total_minutes, total_cpu), load)


def write(args, cfg, phases, seq, depths, final_depths, history, final, final_digits, steps, spent, total, load):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "seq_len", "wall_minutes", "cpu_minutes_of_2_cores", "train_loss",
                    *[f"depth_{d}" for d in depths], "mean", "answer_digits_right"])
        for s, q, mins, cpu, loss, acc, dig in history:
            w.writerow([s, q, f"{mins:.2f}", f"{cpu:.2f}", f"{loss:.4f}", *[f"{a:.3f}" for a in acc],
                        f"{sum(acc) / len(acc):.3f}", f"{dig:.3f}"])
        w.writerow([])
        w.writerow(["final", seq, f"{spent[0]:.2f}", f"{spent[1]:.2f}", "", *[f"depth_{d}" for d in final_depths],
                    "mean", "answer_digits_right"])
        w.writerow(["final", seq, "", "", "", *[f"{a:.3f}" for a in final], f"{final.mean():.3f}",
                    f"{final_digits:.3f}"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for q in sorted({h[1] for h in history}):
        hs = [h for h in history if h[1] == q]
        line, = a1.plot([h[0] for h in hs], [sum(h[5]) / len(h[5]) for h in hs], "o-", ms=3,
                        label=f"mean over depths, {q} tokens")
        a1.plot([h[0] for h in hs], [min(h[5]) for h in hs], "s--", ms=3, color=line.get_color(),
                label=f"worst depth, {q} tokens")
    a1.set(xlabel="train step", ylabel="passkey retrieval accuracy", ylim=(-0.02, 1.02),
           title=f"curriculum {' -> '.join(str(p[0]) for p in phases)} tokens, context {args.context}")
    a1.axhline(args.target, color="gray", lw=0.8)
    a1.legend(fontsize=7)
    a2.bar([f"{d:.1f}" for d in final_depths], final)
    a2.axhline(args.target, color="gray", lw=0.8)
    a2.set(xlabel="needle depth (0 = start of the window)", ylabel="accuracy", ylim=(0, 1.02),
           title=f"{seq} tokens after {steps} steps ({spent[1]:.0f} min of 2 cores, {spent[0]:.0f} min wall)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    cmd = "python experiments/passkey.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    phase_text = "; ".join(f"{q} tokens x {b} sequences for at most {m:g} min of 2 cores"
                           + (f" or {w:g} min wall" if w != float("inf") else "") for q, b, m, w in phases)
    lines = [
        "# Passkey retrieval under context-parallel training from scratch",
        "",
        f"`{cmd}`",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other jobs (load "
        f"average {min(load):.1f}-{max(load):.1f} during the run), 8 simulated CPU devices; finished "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
        "",
        f"Model: {', '.join(MODEL + tuple(args.overrides))} (RoPE). Every phase runs on the same mesh data x fsdp x "
        f"context = 1 x {8 // args.context} x {args.context} (Ulysses all-to-alls over the context axis). Curriculum: "
        f"{phase_text}; a phase before the last ends early once every depth reaches {args.target:.0%} "
        f"{args.patience} evaluations in a row. Batches: passkey documents (`jaxlong.evaluation.probes.passkey_example`, "
        f"{args.train_digits}-digit keys, a uniformly random depth), "
        + (f"every {args.corpus_every}th step a batch of corpus windows (Python stdlib, bytes); "
           if args.corpus_every else "")
        + f"loss on every token, the key's copies (its repeat in the needle and the answer) weighted "
        f"{args.copy_weight:g}. AdamW lr {args.lr} constant after {args.warmup} warmup steps.",
        "",
        f"Time: {steps} steps in {spent[1]:.1f} min of CPU time / 2 cores ({spent[0]:.1f} min wall); with the final "
        f"scoring {total[1]:.1f} / {total[0]:.1f} min.",
        "",
        f"Final retrieval at {seq} tokens, teacher-forced (`jaxlong.evaluation.steps.score_passkey`: every answer byte the "
        f"argmax), {-(-args.final_per_depth // phases[-1][1]) * phases[-1][1]} new {args.digits}-digit keys per depth:",
        "",
        "| depth | " + " | ".join(f"{d:.1f}" for d in final_depths) + " | mean |",
        "|---|" + "---|" * (len(final_depths) + 1),
        "| accuracy | " + " | ".join(f"{a:.2f}" for a in final) + f" | {sum(final) / len(final):.3f} |",
        "",
        f"Answer digits right (each digit teacher-forced on the right previous ones): {final_digits:.3f} "
        f"(chance 0.1).",
        "",
        f"During training (accuracy per depth at the phase's length, {args.eval_per_depth} held-out keys each, rounded "
        f"up to a multiple of the phase's batch):",
        "",
        "| step | seq_len | CPU min / 2 | wall min | train loss | " + " | ".join(f"depth {d}" for d in depths)
        + " | mean | digits right |",
        "|---|---|---|---|---|" + "---|" * (len(depths) + 2),
        *[f"| {s} | {q} | {c:.1f} | {m:.1f} | {l:.3f} | " + " | ".join(f"{x:.2f}" for x in a)
          + f" | {sum(a) / len(a):.2f} | {g:.2f} |" for s, q, m, c, l, a, g in history],
        "",
        f"![curve]({out.with_suffix('.png').name})",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}, .csv, .png")


if __name__ == "__main__":
    main()

"""Does a model trained on one RULER task family solve it, and where does it fail with length? Train a tiny Llama
from scratch on the CPU on a mix of corpus text and generated needle-in-a-haystack cases (RULER's NIAH family:
needles "One of the special magic numbers for KEY is: VALUE." in repeated filler, the question naming the key(s);
the answer the 7-digit value(s)), then score `niah_single_1` with the eval command at the training length and
beyond.

Two ways to train, one scoring:

* Default: `python -m jaxlong.train` (the product's trainer) on a corpus file: `--cases` cases of the `--mix`
  tasks (`jaxlong.evaluation.ruler.make_cases`, seeds other than the eval's, each at a length drawn from its
  range, byte-level so that a case with BOS and EOS fits one `seq_len` sequence) as `{"text": ...}` lines, mixed
  with `--corpus-docs` documents of the default corpus (the Python standard library's sources, each cut to
  `--corpus-chars` characters), shuffled, written to `<work>/corpus.jsonl`; RULER validation every `eval_every`
  steps (`ruler_tasks`, `ruler_lengths`, `ruler_cases`). The trainer weighs every token alike, so the answer is
  8 of ~470 tokens of a case.
* `--copy-weight W`: the same model and optimizer through the library (`jaxlong.training.step`: the trainer's
  compiled step, fed by this script): each batch `global_batch` cases of one `--mix` task at `seq_len` tokens, the
  answer's tokens weighted W in the loss (the `mask` the step already takes as per-token weights), every
  `--corpus-every`-th batch the standard library corpus as the trainer reads it; the parameters are saved as the
  trainer's checkpoint (its config included), so the eval command reads the run unchanged.

With `--copy-weight`, two warm-ups that put a short copy before the task's long one: `--bootstrap N` (the first N
steps on passkey documents, whose key repeats ~15 tokens after its first occurrence) and `--repeats N` (the first N
steps on `repeat_batch`: random strings in the filler, each repeated later); `--passkey-every` and `--repeats-every`
keep mixing them in afterwards.

Then `python -m jaxlong.eval <run> --ruler --ruler-tasks niah_single_1 --ruler-lengths ... --ruler-cases ...`.
Writes `<out>.md` (the commands, the machine, the times, the scores), `<out>.csv` and `<out>.png` (the eval's
ruler.csv and ruler.png).

  python experiments/ruler_demo.py --copy-weight 30 --steps 2400 --eval-every 200 --checkpoint-every 400
                                                        # the result in experiments/results/ruler_demo.md
  python experiments/ruler_demo.py                      # the trainer, unweighted (not learned in 2,000 steps)
  python experiments/ruler_demo.py --skip-train         # score the trained run again
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the CPU demonstration (no CUDA probing)
sys.path.insert(0, str(ROOT))


def train_tasks():
    """The training mix's tasks: `TASKS` plus NIAH variants with a filler haystack and several answers per case
    (more values to copy per sequence than the single needle's one)."""
    from jaxlong.evaluation import ruler

    return {**ruler.TASKS,
            "niah_multivalue_filler": ruler.Task("niah_multivalue_filler", "niah", "filler", num_values=2),
            "niah_multiquery_filler": ruler.Task("niah_multiquery_filler", "niah", "filler", num_queries=2),
            "niah_single_uuids": ruler.Task("niah_single_uuids", "niah", "filler", values="uuids"),
            "niah_single_uuid_keys": ruler.Task("niah_single_uuid_keys", "niah", "filler", keys="uuids",
                                                values="uuids")}


def model_keys(args) -> list[str]:
    """The tiny Llama: hidden 128, head_dim 32, byte-level."""
    return ["model.hidden=128", f"model.layers={args.layers}", f"model.heads={args.heads}",
            f"model.kv_heads={args.heads}", "model.head_dim=32", "model.mlp_hidden=384", "model.vocab_size=257",
            "model.rope_theta=10000"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1", help="the task scored")
    p.add_argument("--mix", default="niah_single_1:360-505,niah_multivalue_filler:440-505,"
                                    "niah_multiquery_filler:475-505",
                   help="training tasks, each TASK:MIN-MAX (case lengths in tokens, drawn uniformly), equal counts")
    p.add_argument("--cases", type=int, default=20000, help="training cases (all tasks together)")
    p.add_argument("--corpus-docs", type=int, default=300, help="corpus documents mixed in")
    p.add_argument("--corpus-chars", type=int, default=1500)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--checkpoint-every", type=int, default=500, help="0: at the end only")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--lengths", default="512,768,1024,2048,4096", help="--ruler-lengths of the final evaluation")
    p.add_argument("--eval-cases", type=int, default=20, help="--ruler-cases of the final evaluation")
    p.add_argument("--work", default="runs/ruler_demo", help="run directory root (corpus and run)")
    p.add_argument("--out", default="experiments/results/ruler_demo")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--copy-weight", type=float, default=0.0,
                   help="> 0: train through the library (`jaxlong.training.step`) instead of `python -m "
                        "jaxlong.train`, on cases generated at `--seq-len` with the answer's tokens weighted this "
                        "much in the loss (the trainer weighs every token alike), every `--corpus-every`-th batch "
                        "corpus text; the run is saved as the trainer's checkpoint, so the eval command reads it")
    p.add_argument("--corpus-every", type=int, default=8, help="with --copy-weight: every k-th batch is corpus")
    p.add_argument("--bootstrap", type=int, default=0,
                   help="with --copy-weight: the first N steps train on passkey documents at `--seq-len` (the "
                        "eval's passkey probe, keys of 3-8 digits, the key's repeat inside the needle and the answer "
                        "weighted): a copy ~15 tokens after its first occurrence, from which a copying circuit "
                        "forms before the task's long copies")
    p.add_argument("--passkey-every", type=int, default=0,
                   help="with --copy-weight, after the bootstrap: every k-th task batch is passkey documents (0: none)")
    p.add_argument("--repeats", type=int, default=0,
                   help="with --copy-weight: the first N steps train on repeat documents (`repeat_batch`: random "
                        "strings in filler, each repeated later, the repeats weighted): an induction head forms on "
                        "them before the task's single copy")
    p.add_argument("--repeats-every", type=int, default=0,
                   help="with --copy-weight, after --repeats: every k-th task batch is repeat documents (0: none)")
    p.add_argument("--resume-to", type=int, default=0,
                   help="continue the trained run to this many steps (`--resume-with-changes steps=N`: the cosine "
                        "schedule is stretched to N), then score it")
    return p.parse_args(argv)


def build_corpus(args, path: Path) -> dict:
    from jaxlong import data
    from jaxlong.evaluation import ruler

    tok = data.get_tokenizer("byte")
    tasks = train_tasks()
    mix = [(name, *map(int, span.split("-"))) for name, span in (x.split(":") for x in args.mix.split(","))]
    rng = np.random.default_rng(1234)
    texts, per = [], -(-args.cases // len(mix))
    for t, (name, lo, hi) in enumerate(mix):  # seeds 1000+: the eval's cases use seed = the run's seed (0)
        lengths = rng.integers(lo, hi + 1, size=per)
        for n in np.unique(lengths):
            for c in ruler.make_cases(tasks[name], tok, int(n), int(np.sum(lengths == n)), seed=1000 + 1000 * t):
                texts.append(bytes(c.tokens[1:].astype(np.uint8).tolist()).decode())  # no BOS: the trainer adds it
    source = data.DocumentSource(None)
    picks = rng.choice(len(source), size=min(args.corpus_docs, len(source)), replace=False)
    corpus = [source[int(i)][:args.corpus_chars] for i in picks]
    docs = texts + corpus
    rng.shuffle(docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    n_tok = sum(len(d.encode()) for d in docs)
    return {"cases": len(texts), "corpus_docs": len(corpus), "bytes": n_tok,
            "case_bytes": sum(len(t.encode()) for t in texts)}


def copy_weights(case, pieces, weight: float) -> np.ndarray:
    """float32 `[length]` loss weights of one NIAH case: `weight` on the targets that copy from earlier in the
    sequence (the answer, and every mention of an asked key after the haystack: the question names it, then the
    answer's lead-in repeats it), 1 elsewhere. The needles themselves are random, so unpredictable: weight 1."""
    targets = case.tokens[1:]
    w = np.ones(targets.shape, np.float32)
    w[case.answer] = weight
    end = case.context[1]  # input index where the question starts
    for key in case.query:
        sub = pieces.slot(key)
        for p in range(end, targets.size - sub.size + 1):
            if np.array_equal(targets[p:p + sub.size], sub):
                w[p:p + sub.size] = weight
    return w


def repeat_batch(rng, length: int, rows: int, weight: float, strings: int | None = None) -> dict:
    """A host batch `[rows, length]` of repeat documents, byte-level: RULER's filler sentences with `strings` random
    strings (default one per 48 tokens) (3-10 characters of digits and lowercase letters) planted in the first half and each repeated once, in
    another order, in the second; loss weight `weight` on each repeat's targets after its first character (those
    an induction head predicts: the token that followed the previous occurrence of the current one), 1 elsewhere.
    The copy that RULER's NIAH answers need (`...: 9607540` in the needle, `...: 9607540` in the answer) in its
    plainest form."""
    from jaxlong.evaluation import FILLER

    strings = strings or max(3, length // 48)  # 10 at 512 tokens: up to 120 of the first half's 256 bytes
    sentences = [" " + x.strip() + "." for x in FILLER.split(".") if x.strip()]
    alphabet = np.frombuffer(b"0123456789abcdefghijklmnopqrstuvwxyz", np.uint8)

    def filler(n):
        out = b""
        while len(out) < n:
            out += sentences[rng.integers(len(sentences))].encode()
        return out[:n]

    inputs, targets, mask = [], [], []
    for _ in range(rows):
        words = [bytes(rng.choice(alphabet, size=int(rng.integers(3, 11)))) for _ in range(strings)]
        half = length // 2
        gaps = rng.multinomial(half - sum(len(w) + 2 for w in words), np.ones(strings + 1) / (strings + 1))
        first = b"".join(filler(g) + b" " + w + b" " for g, w in zip(gaps, words)) + filler(gaps[-1])
        order = rng.permutation(strings)
        rest = length + 1 - 1 - len(first) - sum(len(words[j]) + 2 for j in order)
        gaps = rng.multinomial(max(rest, 0), np.ones(strings + 1) / (strings + 1))
        body, weights = bytearray(first), [1.0] * len(first)
        for g, j in zip(gaps, order):
            part = filler(g) + b" "
            body += part + words[j] + b" "
            weights += [1.0] * len(part) + [1.0] + [weight] * (len(words[j]) - 1) + [1.0]
        body += filler(gaps[-1])
        weights += [1.0] * gaps[-1]
        tokens = np.array([256, *body[:length]], np.int32)  # BOS, then bytes
        inputs.append(tokens[:-1])
        targets.append(tokens[1:])
        mask.append(np.array(weights[:length], np.float32)[:length])
    b = len(inputs)
    return {"inputs": np.stack(inputs), "targets": np.stack(targets), "mask": np.stack(mask),
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
            "segment_ids": np.ones((b, length), np.int32)}


def copies_right(stats, params, batch) -> float:
    """The fraction of a repeat batch's weighted targets (the repeats' predictable characters) whose argmax is
    right."""
    argmax = stats(params, batch)[1]
    w = batch["mask"] > 1
    return float(np.mean(argmax[w] == batch["targets"][w]))


def digits_right(stats, params, cases) -> float:
    """The fraction of the answer's value digits (its leading space left out) whose argmax is right, each
    teacher-forced on the right earlier ones, over `cases` (one batch)."""
    from jaxlong.evaluation import passkey_batch

    batch = passkey_batch(cases)
    argmax = stats(params, batch)[1]
    return float(np.mean([np.mean(argmax[k, c.answer[1:]] == batch["targets"][k, c.answer[1:]])
                          for k, c in enumerate(cases)]))


def train_weighted(args, overrides: list[str], log: Path) -> float:
    """Train through the library with the answers weighted (`--copy-weight`); writes the checkpoint of the last step
    under `<run_dir>/<run_name>/checkpoints` with the run's config, as `python -m jaxlong.train` would; returns the
    wall time (s). Batches: one task of `--mix` per batch (in turn), `global_batch` cases at `seq_len` tokens
    (seeds 100000+, needle depths spread over each batch), loss weights `copy_weights`; every `--corpus-every`-th batch the run's corpus (`data.path`) as the trainer reads it."""
    import jax

    from jaxlong import data
    from jaxlong.config import load_config, to_dict
    from jaxlong.core.mesh import build_mesh
    from experiments.passkey import copy_weights as passkey_weights
    from jaxlong.evaluation import passkey_batch, passkey_example, random_key, ruler, token_stats
    from jaxlong.training import step as step_lib
    from jaxlong.evaluation.ruler.words import Pieces
    from jaxlong.training.checkpoint import Checkpointer

    cfg = load_config(None, overrides)
    mesh, tok, tasks = build_mesh(cfg.mesh), data.get_tokenizer(cfg.data.tokenizer), train_tasks()
    names = [x.split(":")[0] for x in args.mix.split(",")]
    corpus, pieces = data.batch_iterator(cfg, tok), Pieces(tok)
    suite = ruler.RulerSuite([args.task], [cfg.seq_len], 8, cfg.seed)
    held_out = ruler.make_cases(tasks[args.task], tok, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    stats = token_stats(cfg, mesh)
    held_repeats = repeat_batch(np.random.default_rng(99), cfg.seq_len, cfg.global_batch, args.copy_weight)
    t0 = time.time()
    state, train_step = step_lib.init_state(cfg, mesh), step_lib.compile_train_step(cfg, mesh)
    ckpt = Checkpointer(Path(cfg.run_dir) / cfg.run_name / "checkpoints", every=cfg.checkpoint_every,
                        keep=cfg.keep_checkpoints, final_step=cfg.steps)
    with open(log, "w") as f:
        def say(line):
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        def passkey_docs():
            examples = [passkey_example(tok.encode, cfg.seq_len, float(rng.random()),
                                        random_key(rng, int(rng.integers(3, 9)))) for _ in range(cfg.global_batch)]
            b = passkey_batch(examples)
            b["mask"] = np.stack([passkey_weights(e, args.copy_weight) for e in examples])
            return b

        rng = np.random.default_rng(7)
        for i in range(1, cfg.steps + 1):
            if i % args.corpus_every == 0:
                batch = next(corpus)
            elif i <= args.repeats or (args.repeats_every and i % args.repeats_every == 0):
                batch = repeat_batch(rng, cfg.seq_len, cfg.global_batch, args.copy_weight)
            elif i <= args.repeats + args.bootstrap or (args.passkey_every and i % args.passkey_every == 0):
                batch = passkey_docs()
            else:
                cases = ruler.make_cases(tasks[names[i % len(names)]], tok, cfg.seq_len, cfg.global_batch,
                                         seed=100_000 + i)
                batch = passkey_batch(cases)
                batch["mask"] = np.stack([copy_weights(c, pieces, args.copy_weight) for c in cases])
            state, metrics = jax.block_until_ready(train_step(state, step_lib.put_batch(batch, mesh)))
            if i % cfg.log_every == 0:
                say(f"step {i}: loss {float(metrics['loss']):.4f} ({(time.time() - t0) / 60:.1f} min)")
            if i % cfg.eval_every == 0 or i == cfg.steps:
                rows = ruler.evaluate_ruler(cfg, mesh, state["params"], tok, suite)
                say(f"step {i}: ruler " + ", ".join(f"{r['task']}@{r['length']} {r['correct']}/{r['cases']}"
                                                    for r in rows)
                    + f", value digits right {digits_right(stats, state['params'], held_out):.2f}"
                    + f", repeats right {copies_right(stats, state['params'], held_repeats):.2f}")
            if ckpt.should_save(i) or i == cfg.steps:
                ckpt.save(state, to_dict(cfg), force=True)
        ckpt.wait()
        ckpt.close()
    return time.time() - t0


def run(cmd: list[str], log: Path) -> float:
    print("$", shlex.join(cmd), flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode:
        print(log.read_text()[-3000:])
        raise SystemExit(f"{cmd[2]} failed ({p.returncode}); log in {log}")
    return time.time() - t0


def answer_tokens_right(run_dir: Path, step: int, task: str, lengths: list[int], n: int) -> dict[int, float]:
    """The fraction of the value's digits whose argmax is right (each teacher-forced on the right earlier ones;
    the answer's leading space, the same in every case, left out), over the eval's cases at each length: how close
    the model comes when whole answers fail (chance 0.1 per digit)."""
    from jaxlong.config import from_dict
    from jaxlong.core.mesh import build_mesh
    from jaxlong.data import get_tokenizer
    from jaxlong.eval.__main__ import restore_params
    from jaxlong.evaluation import eval_batch_size, passkey_batch, ruler, token_stats
    from jaxlong.training.checkpoint import saved_config

    cfg = from_dict(saved_config(run_dir / "checkpoints", step))
    mesh = build_mesh(cfg.mesh)
    params, stats, tok = restore_params(cfg, mesh, run_dir, step), token_stats(cfg, mesh), get_tokenizer("byte")
    out, size = {}, eval_batch_size(cfg)
    for length in lengths:
        cases = ruler.make_cases(task, tok, length, n, seed=cfg.seed)
        right = []
        for s in range(0, n, size):
            rows = cases[s:s + size]
            batch = passkey_batch(rows + [rows[-1]] * (size - len(rows)))
            argmax = stats(params, batch)[1]
            right += [np.mean(argmax[k, c.answer[1:]] == batch["targets"][k, c.answer[1:]])
                      for k, c in enumerate(rows)]
        out[length] = float(np.mean(right))
    return out


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.work)
    run_name = "run"
    train_cmd = [sys.executable, "-m", "jaxlong.train", f"run_dir={work}", f"run_name={run_name}",
                 f"data.path={work / 'corpus.jsonl'}", "data.tokenizer=byte", f"seq_len={args.seq_len}",
                 f"global_batch={args.batch}", f"steps={args.steps}", f"optim.lr={args.lr}", f"optim.warmup_steps={args.warmup}",
                 "mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "log_every=10",
                 f"checkpoint_every={args.checkpoint_every or args.steps}", "keep_checkpoints=100", f"eval_every={args.eval_every}", "eval_batches=1",
                 "eval_fraction=0.02", f"ruler_tasks=[{args.task}]", f"ruler_lengths=[{args.seq_len}]",
                 "ruler_cases=8", *model_keys(args)]
    eval_cmd = [sys.executable, "-m", "jaxlong.eval", str(work / run_name), "--ruler", "--ruler-tasks", args.task,
                "--ruler-lengths", args.lengths, "--ruler-cases", str(args.eval_cases), "--no-passkey",
                "--batches", "1"]
    started = datetime.datetime.now(datetime.timezone.utc)
    stats, t_train = {}, None
    if args.resume_to:
        train_cmd = [*train_cmd[:3], "--resume-with-changes", *[a for a in train_cmd[3:] if
                                                                  not a.startswith(("steps=", "checkpoint_every="))],
                     f"steps={args.resume_to}", f"checkpoint_every={args.resume_to}"]
        args.steps = args.resume_to
        t_train = run(train_cmd, work / "train_resume.log")
        print(f"trained on in {t_train / 60:.1f} min", flush=True)
    elif args.copy_weight:
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        overrides = [a for a in train_cmd[3:] if not a.startswith(("data.path=", "ruler_", "eval_"))]
        t_train = train_weighted(args, [*overrides, f"eval_every={args.eval_every}"], work / "train.log")
        train_cmd = []
        print(f"trained in {t_train / 60:.1f} min", flush=True)
    elif not args.skip_train:
        if work.exists():
            shutil.rmtree(work)
        stats = build_corpus(args, work / "corpus.jsonl")
        print("corpus:", stats, flush=True)
        t_train = run(train_cmd, work / "train.log")
        print(f"trained in {t_train / 60:.1f} min", flush=True)
    t_eval = run(eval_cmd, work / "eval.log")
    eval_log = (work / "eval.log").read_text()
    summaries = sorted(work.glob(f"{run_name}/eval/*/step_{args.steps}/summary.json"), key=os.path.getmtime)
    summary = json.loads(summaries[-1].read_text())
    step_dir = summaries[-1].parent
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(step_dir / "ruler.csv", out.with_suffix(".csv"))
    shutil.copy(step_dir / "ruler.png", out.with_suffix(".png"))
    train_log = "".join((work / f).read_text() for f in ("train.log", "train_resume.log") if (work / f).exists())
    during = [line for line in train_log.replace("\r", "\n").splitlines()
              if line.startswith("step ") and ("ruler" in line or "eval loss" in line)]
    rows = summary["ruler"]["rows"]
    lengths = [r["length"] for r in rows]
    digits = answer_tokens_right(work / run_name, args.steps, args.task, lengths, args.eval_cases)
    load = os.getloadavg()
    md = [f"# RULER {args.task}: a tiny Llama trained on the task, scored by length", "",
          "Commands:", "", "```", shlex.join(["python", "experiments/ruler_demo.py", *(argv or sys.argv[1:])]),
          "# which runs", (shlex.join(["python", *train_cmd[1:]]) if train_cmd else
                           "# (training through the library: train_weighted, --copy-weight)"),
          shlex.join(["python", *eval_cmd[1:]]), "```", "",
          f"Machine: {platform.machine()} ({platform.processor() or 'CPU'}), 2 cores shared with other jobs (load "
          f"average {load[0]:.1f} at the end), one CPU device; started {started:%Y-%m-%d %H:%M} UTC.", "",
          (f"Model: {', '.join(model_keys(args))}; byte-level; seq_len {args.seq_len}, batch {args.batch}, "
           f"{args.steps} steps, AdamW lr {args.lr} ({args.warmup} warmup steps, cosine decay to 0.1x).")
          if not args.skip_train else "", "",
          (f"Corpus: {stats['cases']} generated cases, equal numbers of each `--mix` entry ({args.mix}: task and "
           f"case lengths in tokens; seeds 1000+, not the eval's), mixed with {stats['corpus_docs']} documents of "
           f"the Python standard library's sources (first {args.corpus_chars} characters each); {stats['bytes']} "
           f"bytes, {100 * stats['case_bytes'] / stats['bytes']:.0f}% of them in cases.") if stats else "", "",
          (f"Time: training {t_train / 60:.1f} min wall" if t_train else "Time: (training not rerun)")
          + f"; final evaluation {t_eval / 60:.1f} min wall.", "",
          f"Final scores, teacher-forced exact match of the 7-digit value, {args.eval_cases} cases per length (needle "
          "depths evenly spread), chance about 1e-7:", "",
          "| task | " + " | ".join(str(r["length"]) for r in rows) + " |",
          "|---|" + "---|" * len(rows),
          f"| {args.task} | " + " | ".join(f"{r['correct']}/{r['cases']} ({100 * r['score']:.0f}%)" for r in rows) + " |",
          "| value digits right (chance 0.10) | " + " | ".join(f"{digits[n]:.2f}" for n in lengths) + " |",
          "", f"![RULER grid]({out.with_suffix('.png').name})", ""]
    if during:
        md += ["Validation during training (held-out loss; RULER `niah_single_1`, 8 cases at the training length, the "
               "`ruler_*` config keys):", "",
               "```", *during, "```", ""]
    md += ["Eval output:", "", "```", *[ln for ln in eval_log.splitlines() if not ln.startswith("eval:")][-25:],
           "```", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Does a model trained on one RULER task family solve it, and where does it fail with length? Train a tiny Llama
from scratch on the CPU on a mix of corpus text and generated `niah_single_1` cases (a single needle "One of the
special magic numbers for KEY is: VALUE." in repeated filler, the question naming KEY; the answer the 7-digit
VALUE), then score the suite with the eval command at the training length and beyond.

1. Corpus: `--cases` training cases (`jaxlong.evaluation.ruler.make_cases`, seeds other than the eval's) at lengths
   drawn from `--case-lengths` (byte-level, so that a case with BOS and EOS fits one `seq_len` sequence), as
   `{"text": ...}` lines, mixed with `--corpus-docs` documents of the default corpus (the Python standard library's
   sources, each cut to `--corpus-chars` characters), shuffled, written to `<work>/corpus.jsonl`.
2. `python -m jaxlong.train` on it (a tiny Llama, byte-level, one device) with RULER validation every `eval_every`
   steps (`ruler_tasks`, `ruler_lengths`, `ruler_cases`).
3. `python -m jaxlong.eval <run> --ruler --ruler-tasks ... --ruler-lengths ... --ruler-cases ...`.

Writes `<out>.md` (the commands, the machine, the times, the scores), `<out>.csv` and `<out>.png` (the eval's
ruler.csv and ruler.png).

  python experiments/ruler_demo.py                      # about 15 min on 2 shared cores
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

MODEL = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.kv_heads=4", "model.head_dim=32",
         "model.mlp_hidden=384", "model.vocab_size=257", "model.rope_theta=10000"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--cases", type=int, default=6000, help="training cases")
    p.add_argument("--case-lengths", default="380,430,470,505", help="training case lengths (tokens)")
    p.add_argument("--corpus-docs", type=int, default=600, help="corpus documents mixed in")
    p.add_argument("--corpus-chars", type=int, default=1500)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--lengths", default="512,1024,2048,4096", help="--ruler-lengths of the final evaluation")
    p.add_argument("--eval-cases", type=int, default=20, help="--ruler-cases of the final evaluation")
    p.add_argument("--work", default="runs/ruler_demo", help="run directory root (corpus and run)")
    p.add_argument("--out", default="experiments/results/ruler_demo")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--resume-to", type=int, default=0,
                   help="continue the trained run to this many steps (`--resume-with-changes steps=N`: the cosine "
                        "schedule is stretched to N), then score it")
    return p.parse_args(argv)


def build_corpus(args, path: Path) -> dict:
    from jaxlong import data
    from jaxlong.evaluation import ruler

    tok = data.get_tokenizer("byte")
    lengths = [int(x) for x in args.case_lengths.split(",")]
    rng = np.random.default_rng(1234)
    texts, per = [], -(-args.cases // len(lengths))
    for i, n in enumerate(lengths):  # seeds 1000+: the eval's cases use seed = the run's seed (0)
        for c in ruler.make_cases(args.task, tok, n, per, seed=1000 + i):
            texts.append(bytes(c.tokens[1:].astype(np.uint8).tolist()).decode())  # without BOS: the trainer adds it
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
    """The fraction of answer tokens whose argmax is right (each teacher-forced on the right earlier ones), over
    the eval's cases at each length: how close the model comes when whole answers fail (chance 0.1 per digit)."""
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
            right += [np.mean(argmax[k, c.answer] == batch["targets"][k, c.answer]) for k, c in enumerate(rows)]
        out[length] = float(np.mean(right))
    return out


def main(argv=None):
    args = parse_args(argv)
    work = Path(args.work)
    run_name = "run"
    train_cmd = [sys.executable, "-m", "jaxlong.train", f"run_dir={work}", f"run_name={run_name}",
                 f"data.path={work / 'corpus.jsonl'}", "data.tokenizer=byte", f"seq_len={args.seq_len}",
                 f"global_batch={args.batch}", f"steps={args.steps}", f"optim.lr={args.lr}", "optim.warmup_steps=30",
                 "mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "log_every=10",
                 f"checkpoint_every={args.steps}", f"eval_every={args.eval_every}", "eval_batches=1",
                 "eval_fraction=0.02", f"ruler_tasks=[{args.task}]", f"ruler_lengths=[{args.seq_len}]",
                 "ruler_cases=8", *MODEL]
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
    during = [line for line in train_log.splitlines() if "ruler" in line.lower() and line.startswith("step ")]
    rows = summary["ruler"]["rows"]
    lengths = [r["length"] for r in rows]
    digits = answer_tokens_right(work / run_name, args.steps, args.task, lengths, args.eval_cases)
    load = os.getloadavg()
    md = [f"# RULER {args.task}: a tiny Llama trained on the task, scored by length", "",
          "Commands:", "", "```", shlex.join(["python", "experiments/ruler_demo.py", *(argv or sys.argv[1:])]),
          "# which runs", shlex.join(["python", *train_cmd[1:]]), shlex.join(["python", *eval_cmd[1:]]), "```", "",
          f"Machine: {platform.machine()} ({platform.processor() or 'CPU'}), 2 cores shared with other jobs (load "
          f"average {load[0]:.1f} at the end), one CPU device; started {started:%Y-%m-%d %H:%M} UTC.", "",
          f"Model: {', '.join(MODEL)}; byte-level; seq_len {args.seq_len}, batch {args.batch}, {args.steps} steps, "
          f"AdamW lr {args.lr} (30 warmup steps, cosine decay)." if not args.skip_train else "", "",
          (f"Corpus: {stats['cases']} `{args.task}` cases at lengths {args.case_lengths} (seeds 1000+, not the "
           f"eval's), mixed with {stats['corpus_docs']} documents of the Python standard library's sources (first "
           f"{args.corpus_chars} characters each); {stats['bytes']} bytes, {100 * stats['case_bytes'] / stats['bytes']:.0f}% "
           f"of them in cases.") if stats else "", "",
          f"Time: training {t_train / 60:.1f} min wall" if t_train else "Time: (training not rerun)",
          f"; final evaluation {t_eval / 60:.1f} min wall.", "",
          f"Final scores, teacher-forced exact match of the 7-digit value, {args.eval_cases} cases per length (needle "
          "depths evenly spread), chance about 1e-7:", "",
          "| task | " + " | ".join(str(r["length"]) for r in rows) + " |",
          "|---|" + "---|" * len(rows),
          f"| {args.task} | " + " | ".join(f"{r['correct']}/{r['cases']} ({100 * r['score']:.0f}%)" for r in rows) + " |",
          "| answer digits right (chance 0.10) | " + " | ".join(f"{digits[n]:.2f}" for n in lengths) + " |",
          "", f"![RULER grid]({out.with_suffix('.png').name})", ""]
    if during:
        md += ["RULER validation during training (8 cases at the training length, `ruler_*` config keys):", "",
               "```", *during, "```", ""]
    md += ["Eval output:", "", "```", *[ln for ln in eval_log.splitlines() if not ln.startswith("eval:")][-25:],
           "```", ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

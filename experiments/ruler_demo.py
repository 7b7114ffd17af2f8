"""Does a model trained on one RULER task family solve it, and where does it fail with length? Train a tiny Llama
from scratch on the CPU on a mix of corpus text and generated needle-in-a-haystack cases (RULER's NIAH family:
needles "One of the special magic numbers for KEY is: VALUE." in repeated filler, the question naming the key(s);
the answer the 7-digit value(s)), then score `niah_single_1` with the eval command at the training length and
beyond.

The recipe that learns (experiments/results/ruler_demo.md: 78% exact matches at 128 tokens, 0% at 256-2048;
about 21 minutes on 2 cores):

  python experiments/ruler_demo.py --bpe 4096 --tie-embeddings --copy-weight 30 --mix niah_single_1 \
      --seq-len 128 --batch 32 --steps 1500 --lr 3e-3 --eval-every 250 --checkpoint-every 500 --corpus-every 8 \
      --lengths 128,256,512,1024,2048 --eval-cases 40

and on cases of 96-128 tokens (experiments/results/ruler_demo_mixed.md): `--mix niah_single_1:96 --steps 1800
--eval-every 300 --checkpoint-every 600 --lengths 96,112,128,160,192,256,512,1024,2048`.

* `--bpe 4096`: a byte-level BPE tokenizer trained for the run (`build_bpe`: Llama 3's pre-tokenizer, so a 7-digit
  value is 3 tokens, `960` `754` `0`, that rarely repeat), saved as a Hugging Face `tokenizer.json` and used as
  `data.tokenizer`; a `niah_single_1` case fits in 96 tokens.
* `--tie-embeddings`: the output projection is the embedding's transpose (as in Llama 3.2 1B and 3B), so copying a
  token from the input needs no per-token output weights.
* `--copy-weight W`: training through the library (`jaxlong.training.step`: the trainer's compiled step, fed by
  this script): each batch `global_batch` cases of one `--mix` task at one length from its least to `seq_len`
  (padded at the end), the copies (the answer, the asked key's mentions after the haystack) weighted W in the
  loss (the `mask` the step takes as per-token weights), every `--corpus-every`-th batch the standard library
  corpus through the trainer's pipeline; the parameters are saved as the trainer's checkpoint (its config
  included), so the eval command reads the run unchanged.

Then `python -m jaxlong.eval <run> --ruler --ruler-scoring forced --ruler-tasks niah_single_1 --ruler-lengths ...
--ruler-cases ...`.
Writes `<out>.md` (the commands, the machine, the times, the scores), `<out>.csv` and `<out>.png` (the eval's
ruler.csv and ruler.png).

Byte-level recipes that did not learn in 500-2,200 steps (the same report lists them): the default, `python -m
jaxlong.train` unweighted on a corpus file of `--cases` cases mixed with `--corpus-docs` documents; `--copy-weight`
with bytes; and two warm-ups that put a short copy before the task's long one, `--bootstrap N` (passkey documents
first) and `--repeats N` (repeated random strings first; `token_repeat_batch` with `--bpe`), with
`--passkey-every` / `--repeats-every` mixing them in afterwards. `--skip-train` scores the trained run again.
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


def model_keys(args, vocab_size: int = 257) -> list[str]:
    """The tiny Llama: hidden 128, head_dim 32, the tokenizer's vocabulary (257: byte-level)."""
    return ["model.hidden=128", f"model.layers={args.layers}", f"model.heads={args.heads}",
            f"model.kv_heads={args.heads}", "model.head_dim=32", "model.mlp_hidden=384",
            f"model.vocab_size={vocab_size}", "model.rope_theta=10000",
            f"model.tie_embeddings={str(args.tie_embeddings).lower()}"]


# Llama 3's pre-tokenizer pattern (its tokenizer.json): numbers split into chunks of at most 3 digits.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def build_bpe(directory: Path, vocab: int, seed: int = 0) -> Path:
    """Train a byte-level BPE `tokenizer.json` the way Llama 3's is built (its pre-tokenizer pattern, byte-level
    alphabet, `<|end_of_text|>` as BOS and EOS), with the `tokenizers` library, on the standard library corpus, the
    RULER templates with their filler, keys and numbers, and every 3-digit chunk (so a 7-digit value is 3 tokens,
    as with Llama 3: `960` `754` `0`). Writes `tokenizer.json` and `tokenizer_config.json` under `directory`
    and returns the `tokenizer.json` path (for `data.tokenizer`)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlong import data
    from jaxlong.evaluation import ruler
    from jaxlong.evaluation.ruler import words

    rng = np.random.default_rng(seed)
    source = data.DocumentSource(None)
    texts = [source[int(i)][:3000] for i in rng.choice(len(source), size=min(400, len(source)), replace=False)]
    byte = data.get_tokenizer("byte")
    texts += [byte.decode(c.tokens[1:])
              for name in ("niah_single_1", "niah_multikey_2") for c in ruler.make_cases(name, byte, 800, 100, seed=7)]
    texts += [" ".join(f"{i:03d}" for i in rng.permutation(1000)) for _ in range(100)]
    texts += [" ".join(rng.permutation(words.NOUNS + words.ADJECTIVES)) for _ in range(50)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|end_of_text|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|end_of_text|>",
                                                                 "eos_token": "<|end_of_text|>"}))
    return directory / "tokenizer.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1", help="the task scored")
    p.add_argument("--bpe", type=int, default=0,
                   help="> 0: train a byte-level BPE tokenizer of this vocabulary (`build_bpe`, Llama 3's pattern) "
                        "into <work>/tokenizer and use it (data.tokenizer) instead of bytes")
    p.add_argument("--mix", default="niah_single_1:360-505,niah_multivalue_filler:440-505,"
                                    "niah_multiquery_filler:475-505",
                   help="training tasks, each TASK:MIN-MAX (case lengths in tokens, drawn uniformly), equal "
                        "counts; with --copy-weight, TASK or TASK:MIN(-MAX): one length per batch from MIN to "
                        "seq_len, padded at the end to seq_len")
    p.add_argument("--cases", type=int, default=20000, help="training cases (all tasks together)")
    p.add_argument("--corpus-docs", type=int, default=300, help="corpus documents mixed in")
    p.add_argument("--corpus-chars", type=int, default=1500)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="model.tie_embeddings=true: the output projection is the embedding's transpose, so copying a "
                        "token needs no per-token output weights (as in Llama 3.2 1B and 3B)")
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
    args = p.parse_args(argv)
    if args.bpe and not args.copy_weight:
        p.error("--bpe trains through the library: give --copy-weight too (e.g. --copy-weight 30)")
    return args


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
                texts.append(tok.decode(c.tokens[1:]))  # no BOS: the trainer adds it
    corpus = corpus_docs(args)
    docs = texts + corpus
    rng.shuffle(docs)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    n_tok = sum(len(d.encode()) for d in docs)
    return {"cases": len(texts), "corpus_docs": len(corpus), "bytes": n_tok,
            "case_bytes": sum(len(t.encode()) for t in texts)}


def corpus_docs(args) -> list[str]:
    """`--corpus-docs` documents of the default corpus (the Python standard library's sources), each cut to
    `--corpus-chars` characters."""
    from jaxlong import data

    source = data.DocumentSource(None)
    picks = np.random.default_rng(1234).choice(len(source), size=min(args.corpus_docs, len(source)), replace=False)
    return [source[int(i)][:args.corpus_chars] for i in picks]


def write_corpus(args, path: Path) -> dict:
    """`corpus_docs` as `{"text": ...}` lines at `path`."""
    docs = corpus_docs(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"corpus_docs": len(docs), "bytes": sum(len(d.encode()) for d in docs)}


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
    strings (default one per 48 tokens) (3-10 characters of digits and lowercase letters) planted in the first half
    and each repeated once, in
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

    docs, mask = [], []
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
        docs.append(np.array([256, *body[:length]], np.int32))  # BOS, then bytes
        mask.append(np.array(weights[:length], np.float32))
    return document_rows(np.stack(docs), np.stack(mask))


def token_repeat_batch(rng, length: int, rows: int, weight: float, ids: np.ndarray, bos: int) -> dict:
    """A host batch `[rows, length]` of repeat documents for a Hugging Face tokenizer: after BOS, a string of
    `period` distinct tokens drawn from `ids` (period drawn per row from 8 to `length // 2`) repeated to fill the
    row; loss weight `weight` on every target after the first period (each is the token that followed the
    previous occurrence of the current one: what an induction head predicts), 1 elsewhere."""
    docs, mask = [], []
    for _ in range(rows):
        period = int(rng.integers(8, length // 2 + 1))
        body = np.resize(rng.choice(ids, size=period, replace=False), length)
        docs.append(np.concatenate([[bos], body]).astype(np.int32))
        w = np.ones(length, np.float32)
        w[period:] = weight  # target index t predicts body[t]: a repeat once t >= period
        mask.append(w)
    return document_rows(np.stack(docs), np.stack(mask))


def number_chunk_ids(tok) -> np.ndarray:
    """The ids of the number chunks `000`-`999` (and `0`-`99`) that the tokenizer spells as one token: what a
    7-digit value is made of."""
    ids = {int(t[0]) for n in range(1000) for text in {f"{n:03d}", str(n)} if (t := tok.encode(text)).size == 1}
    return np.array(sorted(ids), np.int32)


def document_rows(tokens: np.ndarray, mask: np.ndarray) -> dict:
    """A host batch of one document per row: `tokens` int32 `[rows, length + 1]` (inputs and targets shifted by
    one), loss weights `mask` float32 `[rows, length]`."""
    b, length = mask.shape
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (b, length)).copy(),
            "segment_ids": np.ones((b, length), np.int32)}


def padded(batch: dict, mask: np.ndarray, length: int, pad: int) -> dict:
    """`batch` (rows of n <= `length` tokens) with loss weights `mask` `[rows, n]`, padded at the end to `length`
    with `pad` tokens of weight 0 (causal attention: the case's tokens never see the padding)."""
    n = mask.shape[1]
    tokens = np.concatenate([batch["inputs"][:, :1], batch["targets"]], axis=1)
    return document_rows(np.pad(tokens, ((0, 0), (0, length - n)), constant_values=pad),
                         np.pad(mask, ((0, 0), (0, length - n))))


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
    """Train with the trainer (`jaxlong.training.loop.run`) on batches of the demo's own (`run(cfg,
    batches=...)`) with the answers weighted (`--copy-weight`); the checkpoints land under
    `<run_dir>/<run_name>/checkpoints` with the run's config, as `python -m jaxlong.train` writes them; returns the
    wall time (s). Batches: one task of `--mix` per batch (in turn), `global_batch` cases at `seq_len` tokens
    (seeds 100000+, needle depths spread over each batch), loss weights `copy_weights`; every `--corpus-every`-th
    batch the run's corpus (`data.path`) as the trainer reads it. Two hooks log the loss every `log_every` steps
    and score RULER every `eval_every` steps (`jaxlong.training.hooks`). The batches are drawn in step order from
    one generator (as this demo always drew them), so a run of it is not resumed."""
    import dataclasses

    from jaxlong import data
    from jaxlong.config import load_config
    from experiments.passkey import copy_weights as passkey_weights
    from jaxlong.evaluation import passkey_batch, passkey_example, random_key, ruler, token_stats
    from jaxlong.core.mesh import build_mesh
    from jaxlong.evaluation.ruler.words import Pieces
    from jaxlong.training.hooks import Hook
    from jaxlong.recipes import train as run

    cfg = load_config(None, overrides)
    mesh, tok, tasks = build_mesh(cfg.mesh), data.run_tokenizer(cfg), train_tasks()
    mix = [(x.split(":")[0], int(x.split(":")[1].split("-")[0]) if ":" in x else cfg.seq_len)
           for x in args.mix.split(",")]  # (task, the least case length); cases at most seq_len
    corpus, pieces = data.batch_iterator(cfg, tok), Pieces(tok)
    suite = ruler.RulerSuite([args.task], [cfg.seq_len], 8, cfg.seed, scoring="forced")
    held_out = ruler.make_cases(tasks[args.task], tok, cfg.seq_len, cfg.global_batch, seed=cfg.seed)
    stats = token_stats(cfg, mesh)
    if tok.name == "byte":
        def repeats(r):
            return repeat_batch(r, cfg.seq_len, cfg.global_batch, args.copy_weight)
    else:
        chunks = number_chunk_ids(tok)

        def repeats(r):
            return token_repeat_batch(r, cfg.seq_len, cfg.global_batch, args.copy_weight, chunks, tok.bos_id)
    held_repeats = repeats(np.random.default_rng(99))
    rng = np.random.default_rng(7)

    def passkey_docs():
        examples = [passkey_example(tok.encode, cfg.seq_len, float(rng.random()),
                                    random_key(rng, int(rng.integers(3, 9)))) for _ in range(cfg.global_batch)]
        b = passkey_batch(examples)
        b["mask"] = np.stack([passkey_weights(e, args.copy_weight) for e in examples])
        return b

    def batch(i, rows):
        if i % args.corpus_every == 0:
            b = next(corpus)
        elif i <= args.repeats or (args.repeats_every and i % args.repeats_every == 0):
            b = repeats(rng)
        elif i <= args.repeats + args.bootstrap or (args.passkey_every and i % args.passkey_every == 0):
            b = passkey_docs()
        else:
            name, lo = mix[i % len(mix)]
            n = int(rng.integers(lo, cfg.seq_len + 1))
            cases = ruler.make_cases(tasks[name], tok, n, cfg.global_batch, seed=100_000 + i)
            b = padded(passkey_batch(cases), np.stack([copy_weights(c, pieces, args.copy_weight) for c in cases]),
                       cfg.seq_len, tok.eos_id)
        return {k: v[rows] for k, v in b.items()}

    t0 = time.time()
    with open(log, "w") as f:
        def say(line):
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        def log_loss(ctx):
            if ctx.step % cfg.log_every == 0:
                say(f"step {ctx.step}: loss {ctx.metrics['loss']:.4f} ({(time.time() - t0) / 60:.1f} min)")

        def score(ctx):
            rows = ruler.evaluate_ruler(cfg, mesh, ctx.params, tok, suite)
            say(f"step {ctx.step}: ruler " + ", ".join(f"{r['task']}@{r['length']} {r['correct']}/{r['cases']}"
                                                       for r in rows)
                + f", value {'digits' if tok.name == 'byte' else 'tokens'} right "
                + f"{digits_right(stats, ctx.params, held_out):.2f}"
                + (f", repeats right {copies_right(stats, ctx.params, held_repeats):.2f}"
                   if args.repeats or args.repeats_every else ""))

        # the trainer's own validation is off (the demo scores RULER itself); its corpus batches come from `corpus`
        run(dataclasses.replace(cfg, eval_every=0), batches=batch,
            hooks=[Hook(log_loss, every=cfg.log_every, name="loss"), Hook(score, every=cfg.eval_every, name="ruler")])
    return time.time() - t0


def corpus_line(args, stats: dict) -> str:
    """The report's line on the training data."""
    if not stats:
        return ""
    if "cases" not in stats:  # --copy-weight with --bpe: the corpus file of write_corpus
        return (f"Data: batches of `--mix` ({args.mix}) cases generated at one length per batch, from the task's "
                f"least (seq_len if none) to seq_len, padded at the end to seq_len (seeds 100,000+, not the eval's), "
                f"the copies weighted {args.copy_weight:g}; every {args.corpus_every}th batch the corpus file, "
                f"{stats['corpus_docs']} documents of the Python standard library's sources (first "
                f"{args.corpus_chars} characters each, {stats['bytes']} bytes).")
    return (f"Corpus: {stats['cases']} generated cases, equal numbers of each `--mix` entry ({args.mix}: task and "
            f"case lengths in tokens; seeds 1000+, not the eval's), mixed with {stats['corpus_docs']} documents of "
            f"the Python standard library's sources (first {args.corpus_chars} characters each); {stats['bytes']} "
            f"bytes, {100 * stats['case_bytes'] / stats['bytes']:.0f}% of them in cases.")


def cpu_name() -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "CPU"


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
    from jaxlong.data import run_tokenizer
    from jaxlong.data.heldout import eval_batch_size
    from jaxlong.evaluation import passkey_batch, ruler, token_stats
    from jaxlong.training.checkpoint import restore_weights, saved_config

    cfg = from_dict(saved_config(run_dir / "checkpoints", step))
    mesh = build_mesh(cfg.mesh)
    params, stats = restore_weights(cfg, mesh, run_dir / "checkpoints", step), token_stats(cfg, mesh)
    tok = run_tokenizer(cfg)
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
    fresh = not (args.resume_to or args.skip_train)
    if fresh and work.exists():
        shutil.rmtree(work)
    tokenizer, vocab = "byte", 257
    if args.bpe:
        from jaxlong.data import get_tokenizer

        path = work / "tokenizer" / "tokenizer.json"
        tokenizer = str((build_bpe(path.parent, args.bpe) if fresh else path).resolve())
        vocab = get_tokenizer(tokenizer).vocab_size
    train_cmd = [sys.executable, "-m", "jaxlong.train", f"run_dir={work}", f"run_name={run_name}",
                 f"data.path={work / 'corpus.jsonl'}", f"data.tokenizer={tokenizer}", f"seq_len={args.seq_len}",
                 f"global_batch={args.batch}", f"steps={args.steps}", f"optim.lr={args.lr}",
                 f"optim.warmup_steps={args.warmup}",
                 "mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "log_every=10",
                 f"checkpoint_every={args.checkpoint_every or args.steps}", "keep_checkpoints=100",
                 f"eval_every={args.eval_every}", "eval_batches=1",
                 "eval_fraction=0.02", f"ruler_tasks=[{args.task}]", f"ruler_lengths=[{args.seq_len}]",
                 "ruler_cases=8", *model_keys(args, vocab)]
    eval_cmd = [sys.executable, "-m", "jaxlong.eval", str(work / run_name), "--ruler", "--ruler-scoring", "forced",
                "--ruler-tasks", args.task,
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
        work.mkdir(parents=True, exist_ok=True)
        overrides = [a for a in train_cmd[3:] if not a.startswith(("data.path=", "ruler_", "eval_"))]
        if args.bpe:  # the corpus batches from a small file: the trainer's pipeline tokenizes documents whole
            stats = write_corpus(args, work / "corpus.jsonl")
            overrides.append(f"data.path={work / 'corpus.jsonl'}")
        t_train = train_weighted(args, [*overrides, f"eval_every={args.eval_every}"], work / "train.log")
        train_cmd = []
        print(f"trained in {t_train / 60:.1f} min", flush=True)
    elif not args.skip_train:
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
          f"Machine: {platform.machine()} ({cpu_name()}), {os.cpu_count()} cores shared with other jobs (load "
          f"average {load[0]:.1f} at the end), one CPU device; started {started:%Y-%m-%d %H:%M} UTC.", "",
          (f"Model: {', '.join(model_keys(args, vocab))}; " + (
              f"a byte-level BPE tokenizer of {vocab} tokens trained by `build_bpe` (Llama 3's pre-tokenizer)"
              if args.bpe else "byte-level")
           + f"; seq_len {args.seq_len}, batch {args.batch}, {args.steps} steps, AdamW lr {args.lr} ({args.warmup} "
           "warmup steps, cosine decay to 0.1x).") if not args.skip_train else "", "",
          corpus_line(args, stats), "",
          (f"Time: training {t_train / 60:.1f} min wall" if t_train else "Time: (training not rerun)")
          + f"; final evaluation {t_eval / 60:.1f} min wall.", "",
          f"Final scores, teacher-forced exact match of the 7-digit value, {args.eval_cases} cases per length (needle "
          "depths evenly spread), chance about 1e-7:", "",
          "| task | " + " | ".join(str(r["length"]) for r in rows) + " |",
          "|---|" + "---|" * len(rows),
          f"| {args.task} | " + " | ".join(f"{r['correct']}/{r['cases']} ({100 * r['score']:.0f}%)" for r in rows)
          + " |",
          f"| value {'tokens' if args.bpe else 'digits'} right | " + " | ".join(f"{digits[n]:.2f}" for n in lengths)
          + " |",
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

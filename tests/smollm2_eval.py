"""The real model's evaluation checks (tests/evaluation/test_real_model_eval.py): a run trained one step at
learning rate 0 by `python -m jaxlong.train` (`train_one_step`), `python -m jaxlong.eval` on it (`evaluate`), both
run as a user runs them, in a child process, and the forward scored by hand (`Hand`: one device, the weights of the
Hugging Face directory, its tokenizer.json, full `[seq, vocab]` logits, no zigzag layout, no tiled statistics) that
every result of the CLI must equal (`check_ruler`, `check_passkey`, `check_loss`)."""

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from xla_flags import user_env

from jaxlong.config import load_config
from jaxlong.core.mesh import build_mesh
from jaxlong.data import DocumentSource, HFTokenizer
from jaxlong.training.checkpoint import restore_weights
from jaxlong.data.heldout import validation_split
from jaxlong.evaluation import PositionLoss
from jaxlong.evaluation.probes import passkey_example, random_key
from jaxlong.evaluation.ruler import make_cases
from jaxlong.models import hf
from jaxlong.config import runtime
from jaxlong.models.llama import forward, model_graphdef

ROOT = Path(__file__).resolve().parents[1]
RING8 = ("mesh.num_devices=8", "mesh.fsdp=1", "mesh.ring=8", "mesh.context=1")
ONE_DEVICE = ("mesh.num_devices=1", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=1")
PASSKEY = ("--lengths", "1024", "--depths", "0,0.5,1", "--per-cell", "1")
FAMILIES = ("niah_single_1", "vt", "cwe", "fwe")  # retrieval, tracing, aggregation (both)
# The hand-scored forward's answers to the RULER cases of tests/evaluation/test_real_model_eval.py (one case of
# each family at 2K and 4K, vt and fwe at 1K), written by `python tests/smollm2_eval.py` (about 10 min on one core):
# the 4K forwards, not the checks, are that test's cost.
RULER_ANSWERS = Path(__file__).parent / "fixtures" / "smollm2" / "ruler_answers.json"
RULER_SETS = ((("vt", "fwe"), (1024,)), (FAMILIES, (2048, 4096)))


def cli(module: str, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a child process, as a user runs it (tests/xla_flags.py `user_env`); fails the
    test with the exit status and the output's tail (a crash's signal and message included) unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=user_env(dict(os.environ), str(ROOT)),
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"python -m {module} {' '.join(args)}: exit {proc.returncode}\n--- stdout\n" \
                                 f"{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    return proc


def train_one_step(smol: Path, root: Path) -> Path:
    """A run directory as `python -m jaxlong.train model.from_hf=DIR seq_len=512 global_batch=1 mesh.ring=8
    mesh.context=1 mesh.fsdp=1 steps=1` leaves it (under `root`); its checkpoint holds the pretrained weights
    exactly (learning rate 0 at step 1, checked)."""
    overrides = [f"model.from_hf={smol}", "seq_len=512", "global_batch=1", *RING8, "steps=1", "eval_every=0",
                 "checkpoint_every=1", f"run_dir={root}", "run_name=smol"]
    cli("jaxlong.train", *overrides)
    cfg = load_config(None, overrides)
    mesh = build_mesh(cfg.mesh)
    restored, imported = restore_weights(cfg, mesh, root / "smol" / "checkpoints", 1), hf.load_params(smol, cfg.model, mesh, cfg.param_dtype)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(imported)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)  # learning rate 0 at step 1
    return root / "smol"


class Hand:
    """The forward scored by hand: one device, the weights of the Hugging Face directory, full logits. Its answers
    and losses are kept by input, so that the checks of the CLI on several meshes run each forward once."""

    def __init__(self, smol: Path):
        self.smol, self.tokenizer = smol, HFTokenizer(smol)
        self.cfg = load_config(None, [f"model.from_hf={smol}", "seq_len=512", "global_batch=1", *ONE_DEVICE])
        self.mesh = build_mesh(self.cfg.mesh)
        self.params = hf.load_params(smol, self.cfg.model, self.mesh, self.cfg.param_dtype)
        self._runs, self._memo = {}, {}

    def logits(self, tokens: np.ndarray, positions=None, segment_ids=None) -> np.ndarray:
        """Float32 `[b, s, vocab]` logits of `tokens` `[b, s]`."""
        n = tokens.shape[1]
        if n not in self._runs:
            cfg = load_config(None, [f"model.from_hf={self.smol}", f"seq_len={n}", "global_batch=1", *ONE_DEVICE])
            rt, graphdef = runtime(cfg, self.mesh), model_graphdef(cfg.model, cfg.param_dtype)

            def run(p, t, pos, seg):
                hidden, head = forward(graphdef, p, t, rt, pos, seg)
                return jnp.einsum("bsh,hv->bsv", hidden, head)

            self._runs[n] = jax.jit(run)
        return np.asarray(self._runs[n](self.params, tokens, positions, segment_ids))

    def answer(self, tokens: np.ndarray, answer: np.ndarray) -> np.ndarray:
        """The argmax at the answer positions (targets' indexes) of a case's `tokens` `[length + 1]`."""
        key = ("answer", np.asarray(tokens).tobytes(), np.asarray(answer).tobytes())
        if key not in self._memo:
            self._memo[key] = self.logits(tokens[None, :-1])[0, answer].argmax(-1)
        return self._memo[key]

    def token_losses(self, batch: dict) -> np.ndarray:
        """Float64 `[b, s]` next-token losses of a packed batch (positions and segment ids)."""
        key = ("loss", *(np.asarray(batch[k]).tobytes() for k in ("inputs", "targets", "positions", "segment_ids")))
        if key not in self._memo:
            logits = self.logits(batch["inputs"], batch["positions"], batch["segment_ids"]).astype(np.float64)
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            self._memo[key] = lse - np.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        return self._memo[key]


def evaluate(run_dir: Path, *args: str) -> tuple[dict, list[dict]]:
    """`python -m jaxlong.eval RUN_DIR ARGS` (`cli`): its summary.json and ruler_cases.csv rows."""
    before = set(run_dir.glob("eval/*/step_1/summary.json"))
    cli("jaxlong.eval", str(run_dir), *args)
    out = max(set(run_dir.glob("eval/*/step_1/summary.json")) - before or run_dir.glob("eval/*/step_1/summary.json"),
              key=lambda p: p.stat().st_mtime).parent
    cases = list(csv.DictReader(open(out / "ruler_cases.csv"))) if (out / "ruler_cases.csv").is_file() else []
    return json.loads((out / "summary.json").read_text()), cases


def _case_key(task: str, length: int, index: int) -> str:
    return f"{task}/{length}/{index}"


def hand_ruler_answers(hand: Hand, tasks, lengths, n: int) -> dict:
    """The hand-scored forward's answer to each case (seed 0): `{"task/length/index": {"tokens_sha256", "correct",
    "predicted", "answer"}}`, `tokens_sha256` of the case's int32 tokens (the case the answer belongs to)."""
    out = {}
    for task in tasks:
        for length in lengths:
            for c in make_cases(task, hand.tokenizer, length, n, seed=0):
                mine = hand.answer(c.tokens, c.answer)
                out[_case_key(task, length, c.index)] = {
                    "tokens_sha256": hashlib.sha256(np.asarray(c.tokens, np.int32).tobytes()).hexdigest(),
                    "correct": int(np.array_equal(mine, c.tokens[1:][c.answer])),
                    "predicted": hand.tokenizer.decode(mine), "answer": c.answer_text}
    return out


def stored_ruler_answers(hand: Hand, tasks, lengths, n: int) -> dict:
    """`hand_ruler_answers` as `RULER_ANSWERS` stores them, after checking that its cases are the ones
    `make_cases` generates today (token by token, through the hash); a changed generator asks for a new file."""
    stored = json.loads(RULER_ANSWERS.read_text())
    out = {}
    for task in tasks:
        for length in lengths:
            for c in make_cases(task, hand.tokenizer, length, n, seed=0):
                key = _case_key(task, length, c.index)
                assert key in stored, f"{RULER_ANSWERS.name} has no {key}: run python tests/smollm2_eval.py"
                sha = hashlib.sha256(np.asarray(c.tokens, np.int32).tobytes()).hexdigest()
                assert stored[key]["tokens_sha256"] == sha, \
                    f"{key}: make_cases generates another case than {RULER_ANSWERS.name} answers; run " \
                    "python tests/smollm2_eval.py to score the new cases by hand"
                out[key] = stored[key]
    return out


def check_ruler(hand: Hand, cases: list[dict], tasks, lengths, n: int, answers: dict | None = None) -> None:
    """The CLI's RULER answers (`ruler_cases.csv`) equal the hand-scored forward's, case by case: computed here,
    or `answers` (`stored_ruler_answers`)."""
    got = {(r["task"], int(r["length"]), int(r["index"])): r for r in cases}
    assert len(got) == len(tasks) * len(lengths) * n
    want = answers if answers is not None else hand_ruler_answers(hand, tasks, lengths, n)
    for (task, length, index), row in got.items():
        w = want[_case_key(task, length, index)]
        assert (int(row["correct"]), row["predicted"], row["answer"]) == (w["correct"], w["predicted"], w["answer"]), \
            (task, length, index)


def check_passkey(hand: Hand, summary: dict) -> None:
    """The CLI's passkey grid equals the hand-scored forward's, cell by cell (the same keys: seed 0)."""
    pk = summary["passkey"]
    rng = np.random.default_rng([0, 2])
    want = np.zeros((len(pk["depths"]), len(pk["lengths"])))
    for j, length in enumerate(pk["lengths"]):
        for i, depth in enumerate(pk["depths"]):
            for _ in range(pk["per_cell"]):
                ex = passkey_example(hand.tokenizer.encode, length, depth, random_key(rng, pk["digits"]))
                want[i, j] += np.array_equal(hand.answer(ex.tokens, ex.answer), ex.tokens[1:][ex.answer])
    np.testing.assert_array_equal(np.asarray(pk["accuracy"]), want / pk["per_cell"])


def check_loss(hand: Hand, run_dir: Path, summary: dict, global_batch: int = 1) -> None:
    """The CLI's validation loss and loss by position equal the hand-scored forward's on the same held-out batch of
    `global_batch` rows (packed documents: positions and segment ids)."""
    cfg = load_config(None, [f"model.from_hf={hand.smol}", "seq_len=512", f"global_batch={global_batch}", *RING8])
    _, batches = validation_split(cfg, DocumentSource(cfg.data.path, cfg.data.text_field), hand.tokenizer, 1)
    by_pos, total, count = PositionLoss(cfg.seq_len), 0.0, 0.0
    for b in batches:
        loss = hand.token_losses(b)
        mask = np.asarray(b["mask"], np.float64)
        by_pos.add(loss, mask)
        total, count = total + float((loss * mask).sum()), count + float(mask.sum())
    assert abs(summary["loss"] - total / count) < 1e-4 and summary["tokens"] == count
    for got, want in zip(summary["loss_by_position"], by_pos.rows(), strict=True):
        assert got["tokens"] == want["tokens"] and abs(got["loss"] - want["loss"]) < 1e-3, (got, want)


if __name__ == "__main__":  # python tests/smollm2_eval.py [MODEL_DIR]: write RULER_ANSWERS
    import smollm2  # noqa: PLC0415

    jax.config.update("jax_default_matmul_precision", "highest")
    hand = Hand(Path(sys.argv[1]) if len(sys.argv) > 1 else smollm2.build())
    answers = {}
    for tasks, lengths in RULER_SETS:
        answers.update(hand_ruler_answers(hand, tasks, lengths, 1))
    RULER_ANSWERS.write_text(json.dumps(answers, indent=1, sort_keys=True) + "\n")
    print(f"{RULER_ANSWERS}: {sum(a['correct'] for a in answers.values())} of {len(answers)} answered")

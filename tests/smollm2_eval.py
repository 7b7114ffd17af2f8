"""The real model's evaluation checks (tests/evaluation/test_real_model_*.py): a run trained one step at learning
rate 0 (`train_one_step`), `python -m jaxlong.eval` on it (`evaluate`), and the forward scored by hand (`Hand`: one
device, the weights of the Hugging Face directory, its tokenizer.json, full `[seq, vocab]` logits, no zigzag
layout, no tiled statistics) that every result of the CLI must equal (`check_ruler`, `check_passkey`,
`check_loss`)."""

import csv
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.config import load_config
from jaxlong.core.mesh import build_mesh
from jaxlong.data import DocumentSource, HFTokenizer
from jaxlong.eval.__main__ import main as eval_main
from jaxlong.eval.__main__ import restore_params
from jaxlong.evaluation import PositionLoss, validation_split
from jaxlong.evaluation.probes import passkey_example, random_key
from jaxlong.evaluation.ruler import make_cases
from jaxlong.models import hf
from jaxlong.models.llama import Runtime, forward, model_graphdef

RING8 = ("mesh.num_devices=8", "mesh.fsdp=1", "mesh.ring=8", "mesh.context=1")
ONE_DEVICE = ("mesh.num_devices=1", "mesh.fsdp=1", "mesh.ring=1", "mesh.context=1")
PASSKEY = ("--lengths", "1024", "--depths", "0,0.5,1", "--per-cell", "1")
FAMILIES = ("niah_single_1", "vt", "cwe", "fwe")  # retrieval, tracing, aggregation (both)


def train_one_step(smol: Path, root: Path) -> Path:
    """A run directory as `python -m jaxlong.train model.from_hf=DIR seq_len=512 global_batch=1 mesh.ring=8
    mesh.context=1 mesh.fsdp=1 steps=1` leaves it (under `root`); its checkpoint holds the pretrained weights
    exactly (learning rate 0 at step 1, checked)."""
    from jaxlong.training.loop import run  # noqa: PLC0415

    cfg = load_config(None, [f"model.from_hf={smol}", "seq_len=512", "global_batch=1", *RING8, "steps=1",
                             "eval_every=0", "checkpoint_every=1", f"run_dir={root}", "run_name=smol"])
    run(cfg)
    mesh = build_mesh(cfg.mesh)
    restored, imported = restore_params(cfg, mesh, root / "smol", 1), hf.load_params(smol, cfg, mesh)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(imported)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)  # learning rate 0 at step 1
    return root / "smol"


class Hand:
    """The forward scored by hand: one device, the weights of the Hugging Face directory, full logits."""

    def __init__(self, smol: Path):
        self.smol, self.tokenizer = smol, HFTokenizer(smol)
        self.cfg = load_config(None, [f"model.from_hf={smol}", "seq_len=512", "global_batch=1", *ONE_DEVICE])
        self.mesh = build_mesh(self.cfg.mesh)
        self.params = hf.load_params(smol, self.cfg, self.mesh)
        self._runs = {}

    def logits(self, tokens: np.ndarray, positions=None, segment_ids=None) -> np.ndarray:
        """Float32 `[b, s, vocab]` logits of `tokens` `[b, s]`."""
        n = tokens.shape[1]
        if n not in self._runs:
            cfg = load_config(None, [f"model.from_hf={self.smol}", f"seq_len={n}", "global_batch=1", *ONE_DEVICE])
            rt, graphdef = Runtime(mesh=self.mesh, cfg=cfg), model_graphdef(cfg)

            def run(p, t, pos, seg):
                hidden, head = forward(graphdef, p, t, rt, pos, seg)
                return jnp.einsum("bsh,hv->bsv", hidden, head)

            self._runs[n] = jax.jit(run)
        return np.asarray(self._runs[n](self.params, tokens, positions, segment_ids))

    def answer(self, tokens: np.ndarray, answer: np.ndarray) -> np.ndarray:
        """The argmax at the answer positions (targets' indexes) of a case's `tokens` `[length + 1]`."""
        return self.logits(tokens[None, :-1])[0, answer].argmax(-1)


def evaluate(run_dir: Path, *args: str) -> tuple[dict, list[dict]]:
    """`python -m jaxlong.eval RUN_DIR ARGS`: its summary.json and ruler_cases.csv rows."""
    before = set(run_dir.glob("eval/*/step_1/summary.json"))
    assert eval_main([str(run_dir), *args]) == 0
    out = max(set(run_dir.glob("eval/*/step_1/summary.json")) - before or run_dir.glob("eval/*/step_1/summary.json"),
              key=lambda p: p.stat().st_mtime).parent
    cases = list(csv.DictReader(open(out / "ruler_cases.csv"))) if (out / "ruler_cases.csv").is_file() else []
    return json.loads((out / "summary.json").read_text()), cases


def check_ruler(hand: Hand, cases: list[dict], tasks, lengths, n: int) -> None:
    """The CLI's RULER answers (`ruler_cases.csv`) equal the hand-scored forward's, case by case."""
    got = {(r["task"], int(r["length"]), int(r["index"])): r for r in cases}
    assert len(got) == len(tasks) * len(lengths) * n
    for task in tasks:
        for length in lengths:
            for c in make_cases(task, hand.tokenizer, length, n, seed=0):
                mine = hand.answer(c.tokens, c.answer)
                right = int(np.array_equal(mine, c.tokens[1:][c.answer]))
                row = got[(task, length, c.index)]
                assert (int(row["correct"]), row["predicted"], row["answer"]) == \
                    (right, hand.tokenizer.decode(mine), c.answer_text), (task, length, c.index)


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


def check_loss(hand: Hand, run_dir: Path, summary: dict) -> None:
    """The CLI's validation loss and loss by position equal the hand-scored forward's on the same held-out batch
    (packed documents: positions and segment ids)."""
    cfg = load_config(None, [f"model.from_hf={hand.smol}", "seq_len=512", "global_batch=1", *RING8])
    _, batches = validation_split(cfg, DocumentSource(cfg.data.path, cfg.data.text_field), hand.tokenizer, 1)
    by_pos, total, count = PositionLoss(cfg.seq_len), 0.0, 0.0
    for b in batches:
        logits = hand.logits(b["inputs"], b["positions"], b["segment_ids"]).astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        loss = lse - np.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
        mask = np.asarray(b["mask"], np.float64)
        by_pos.add(loss, mask)
        total, count = total + float((loss * mask).sum()), count + float(mask.sum())
    assert abs(summary["loss"] - total / count) < 1e-4 and summary["tokens"] == count
    for got, want in zip(summary["loss_by_position"], by_pos.rows(), strict=True):
        assert got["tokens"] == want["tokens"] and abs(got["loss"] - want["loss"]) < 1e-3, (got, want)

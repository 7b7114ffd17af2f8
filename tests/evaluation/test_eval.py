"""Evaluation: held-out split, eval loss on the training mesh against one device, per-token stats, passkey
scoring checked on predictors that cannot fail and cannot succeed, the train-loop hook and the CLI."""

import csv
import dataclasses
import functools
import json
import re

import jax
import numpy as np
import pytest
from helpers import mesh_for, pairwise, random_batch, reference_cfg, tiered, tiny_cfg
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxlong import evaluation as ev
from jaxlong.evaluation import ruler
from jaxlong.core.memstats import compiled_bytes
from jaxlong.core.mesh import resolve_mesh_shape
from jaxlong.core.batch import put_batch
from jaxlong.data import ByteTokenizer, PipelineOptions, make_dataset
from jaxlong.layers import loss as loss_lib
from jaxlong.config import runtime
from jaxlong.models.llama import forward, model_graphdef
from jaxlong.training import step as step_lib
from jaxlong.data import heldout
from jaxlong.evaluation import checkpoint as evaluation

TEXTS = [("The grass is green and the sky is blue. " * (1 + i % 4))[: 20 + 13 * i] for i in range(24)]


def test_held_out_documents_are_whole_and_fixed_by_seed():
    tok = ByteTokenizer()
    held = heldout.held_out_documents(TEXTS, tok, 0.25, seed=0)
    assert len(held) == 6 and held == sorted(held)
    assert heldout.held_out_documents(TEXTS, tok, 0.25, seed=0) == held
    assert heldout.held_out_documents(TEXTS, tok, 0.25, seed=1) != held
    more = heldout.held_out_documents(TEXTS, tok, 0.25, seed=0, min_tokens=1500)  # more documents to fill the batches
    assert set(held) <= set(more) and sum(len(TEXTS[i]) + 2 for i in more) >= 1500
    assert len(heldout.held_out_documents(TEXTS, tok, 0.25, seed=0, min_tokens=10**9)) == len(TEXTS) - 1
    with pytest.raises(ValueError, match="eval_fraction.* 1 document"):
        heldout.held_out_documents(TEXTS[:1], tok, 0.1, seed=0)
    with pytest.raises(ValueError, match="eval_batches=40: .* lower eval_batches or seq_len"):
        heldout.validation_split(tiny_cfg("model.vocab_size=257", "eval_batches=40"), TEXTS, tok)


@pytest.mark.parametrize("packing", ["documents", "concat"])
def test_validation_batches_present_documents_as_training_does(packing):
    tok = ByteTokenizer()
    cfg = tiny_cfg("model.vocab_size=257", "seq_len=16", "global_batch=1", "mesh.fsdp=1", "mesh.context=8", f"data.packing={packing}")
    (batch,) = heldout.validation_batches(cfg, ["ABCD", "xyz"], tok, [0, 1], 1)
    train = next(iter(make_dataset(["ABCD", "xyz"], tok, seq_len=16, global_batch=1,
                                   options=PipelineOptions(seed=cfg.seed, packing=packing, shuffle=False))))
    docs = batch["mask"] > 0  # training goes on with the next epoch where validation pads
    for k in ("inputs", "targets", "positions", "segment_ids", "mask"):
        np.testing.assert_array_equal(batch[k][docs], train[k][docs], err_msg=k)
    if packing == "documents":  # each BOS stays with its document: "[BOS]ABCD" predicts ABCD[EOS]
        np.testing.assert_array_equal(batch["segment_ids"][0], [1] * 5 + [2] * 4 + [0] * 7)
        np.testing.assert_array_equal(batch["positions"][0][:9], [0, 1, 2, 3, 4, 0, 1, 2, 3])
        assert batch["inputs"][0][0] == tok.bos_id and batch["targets"][0][0] == ord("A")
        np.testing.assert_array_equal(batch["mask"][0], batch["segment_ids"][0] > 0)
    indices, batches = heldout.validation_split(tiny_cfg("model.vocab_size=257"), TEXTS, tok)
    assert len(batches) == 2 and all(b["inputs"].shape == (2, 64) for b in batches)


def _eval_loss(cfg, n_devices, batch, params_host=None):
    mesh = mesh_for(cfg, n_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    if params_host is not None:
        params = jax.tree.map(lambda h, p: jax.device_put(h, p.sharding), params_host, params)
    s, _, c = ev.make_eval_step(cfg, mesh)(params, put_batch(batch, mesh))
    return float(s) / float(c), jax.tree.map(np.asarray, params)


@pytest.mark.parametrize(*tiered("extra", [
    ("attention.impl=ulysses", "tiling.loss=true", "tiling.loss_tile=8", "tiling.mlp=true"),
    ("attention.impl=upipe", "attention.heads_per_stage=4", "remat.policy=full"),
], ids=["fsdp_ulysses_tiled", "fsdp_upipe"], fast={"fsdp_upipe"}))
def test_eval_loss_on_the_mesh_equals_single_device(extra):
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "global_batch=2", *extra)
    batch = random_batch(cfg, seed=4)
    ref_loss, params = _eval_loss(reference_cfg(cfg), 1, batch)
    loss, _ = _eval_loss(cfg, 8, batch, params_host=params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)


@pytest.mark.slow
def test_eval_step_needs_less_memory_than_the_train_step():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "seq_len=256", "tiling.loss=true")
    mesh = mesh_for(cfg, 8)
    train = compiled_bytes(step_lib.compile_train_step(cfg, mesh))
    evaluation = compiled_bytes(ev.compile_eval_step(cfg, mesh))
    assert evaluation["peak"] < train["peak"]
    assert evaluation["argument"] < train["argument"]  # parameters only: no optimizer state


def test_token_stats_over_tiles_on_the_mesh_equal_dense_logits():
    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "tiling.loss_tile=4")
    batch = random_batch(cfg, seed=5)
    ref = reference_cfg(cfg)
    mesh1 = mesh_for(ref, 1)
    params = step_lib.init_state(ref, mesh1)["params"]
    hidden, head = jax.jit(lambda p, x: forward(model_graphdef(ref.model, ref.param_dtype), p, x, runtime(ref, mesh1)))(
        params, batch["inputs"])
    want_loss = np.asarray(loss_lib.token_losses(hidden, head, batch["targets"]))
    want_arg = np.asarray(jax.numpy.argmax(jax.numpy.einsum("bsh,hv->bsv", hidden, head), axis=-1))
    mesh = mesh_for(cfg, 8)
    params8 = jax.tree.map(lambda h, p: jax.device_put(np.asarray(h), p.sharding), params,
                           step_lib.init_state(cfg, mesh)["params"])
    loss, arg = ev.token_stats(cfg, mesh)(params8, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(arg, want_arg)


# Every mesh the trainer takes, each with packed documents and with one causal stream per row.
MESHES = {
    "ulysses": ("mesh.fsdp=2", "mesh.context=4"),
    "upipe": ("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"),
    "ring": ("mesh.fsdp=4", "mesh.ring=2", "mesh.context=1"),
    "ulysses-ring": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4"),
    "upipe-ring": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe"),
}
GRID = ev.PasskeyGrid(lengths=[128], depths=[0.0, 1.0], per_cell=4)


def _eval_cfg(packing, *mesh):
    return tiny_cfg("model.vocab_size=257", "global_batch=4", f"data.packing={packing}", *mesh)


@functools.lru_cache(maxsize=None)
def _one_device_eval(packing):
    """Parameters, validation batches and `evaluate_params` of the dense single-device reference."""
    ref = reference_cfg(_eval_cfg(packing, "mesh.fsdp=2", "mesh.context=4"))
    mesh = mesh_for(ref, 1)
    params = step_lib.init_state(ref, mesh)["params"]
    _, batches = heldout.validation_split(ref, TEXTS, ByteTokenizer())
    result = ev.evaluate_params(ref, mesh, params, batches, encode=ENC, passkey=GRID)
    passkey = ev.passkey_batch([ev.passkey_example(ENC, 128, d, "31415") for d in (0.0, 0.3, 0.6, 1.0)])
    hidden, head = jax.jit(lambda p, x: forward(model_graphdef(ref.model, ref.param_dtype), p, x, runtime(ref, mesh)))(
        params, passkey["inputs"])
    top2 = np.sort(np.asarray(jax.numpy.einsum("bsh,hv->bsv", hidden, head)), axis=-1)[..., -2:]
    return jax.tree.map(np.asarray, params), batches, result, passkey, top2[..., 1] - top2[..., 0]


@pytest.mark.parametrize(*pairwise({"mesh": list(MESHES), "packing": ["documents", "concat"]},
                                   fast=[("ring", "documents")], cover=False))
def test_evaluation_on_every_mesh_equals_one_device(mesh, packing):
    """Validation loss, per-token losses, loss by position, passkey scores and argmax of the same parameters on
    each mesh equal one device's (float32, rtol 1e-5): batches take the train step's layout (zigzag under ring)
    and per-token results come back in token order."""
    params1, batches, want, passkey, margin = _one_device_eval(packing)
    cfg = _eval_cfg(packing, *MESHES[mesh])
    m = mesh_for(cfg, 8)
    params = jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), params1,
                          step_lib.abstract_state(cfg, m)["params"])
    counts = []
    got = ev.evaluate_params(cfg, m, params, batches, encode=ENC, passkey=GRID, progress=counts.append)
    # progress: each validation sequence once (after its batch's two forwards), then each passkey example
    size = heldout.eval_batch_size(cfg)
    assert counts == [len(b["inputs"]) for b in batches] + [size] * (2 * -(-GRID.per_cell // size))
    assert sum(counts) == ev.sequences_to_evaluate(cfg, batches, GRID)
    np.testing.assert_allclose(got.loss, want.loss, rtol=1e-5)
    assert got.tokens == want.tokens
    for a, b in zip(got.token_loss, want.token_loss, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert [r["tokens"] for r in got.by_position] == [r["tokens"] for r in want.by_position]
    np.testing.assert_allclose([r["loss"] for r in got.by_position], [r["loss"] for r in want.by_position],
                               rtol=1e-5)
    np.testing.assert_array_equal(got.passkey, want.passkey)
    _, argmax = ev.token_stats(cfg, m)(params, passkey)
    _, want_argmax = ev.token_stats(reference_cfg(cfg), mesh_for(reference_cfg(cfg), 1))(params1, passkey)
    clear = margin > 1e-4  # tokens whose two best logits are not a float32 tie
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(argmax[clear], want_argmax[clear])


def test_position_buckets_are_log_spaced_to_the_full_length():
    np.testing.assert_array_equal(ev.position_buckets(8), [0, 1, 2, 4, 8])
    np.testing.assert_array_equal(ev.position_buckets(12), [0, 1, 2, 4, 8, 12])
    acc = ev.PositionLoss(8)
    acc.add(np.arange(16, dtype=float).reshape(2, 8), np.ones((2, 8)))
    assert [r["loss"] for r in acc.rows()] == [4.0, 5.0, 6.5, 9.5]


# ----------------------------------------------------------------------------------------------
# Passkey: the example and the metric.

ENC = ByteTokenizer().encode


def test_passkey_example_layout():
    where = []
    for depth in (0.0, 0.5, 1.0):
        e = ev.passkey_example(ENC, 512, depth, "31415")
        assert e.tokens.shape == (513,) and e.depth == pytest.approx(depth, abs=0.01)
        text = bytes(e.tokens.astype(np.uint8)).decode()
        assert text.endswith("What is the pass key? The pass key is 31415") and text.count("31415") == 3
        assert bytes(e.tokens[1:][e.answer].astype(np.uint8)).decode() == "31415"  # the answer = the last targets
        where.append(text.index("The pass key is 31415. Remember"))
    assert where[0] == 0 and where[0] < where[1] < where[2]
    assert text[where[2]:].startswith(ev.NEEDLE.format(key="31415") + ev.QUESTION.format(key="31415")[:4])
    with pytest.raises(ValueError, match="too short"):
        ev.passkey_example(ENC, 40, 0.5, "31415")


def _oracle(batch):
    """Retrieves by construction: reads the key after the first "The pass key is " of each row's *input* and
    predicts it at the end; everything else is predicted as the true next token."""
    out = batch["targets"].copy()
    cue = np.frombuffer(b"The pass key is ", np.uint8).astype(np.int32)
    for row, inp in zip(out, batch["inputs"]):
        starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(inp, cue.size) == cue, axis=1))
        key = []
        for t in inp[starts[0] + cue.size:]:
            if not 48 <= t <= 57:
                break
            key.append(t)
        row[-len(key):] = key
    return out


def _no_needle(batch):
    """Knows the format, not the key: every digit it predicts is off by one."""
    out = batch["targets"].copy()
    digit = (out >= 48) & (out <= 57)
    out[digit] = 48 + (out[digit] - 48 + 1) % 10
    return out


def _one_digit_wrong(batch):
    out = _oracle(batch)
    out[:, -2] = 48 + (out[:, -2] - 48 + 1) % 10
    return out


@pytest.mark.parametrize("predict, want", [(_oracle, 1.0), (_no_needle, 0.0), (_one_digit_wrong, 0.0)],
                         ids=["cannot_fail", "cannot_succeed", "one_digit_wrong"])
def test_passkey_score_of_predictors_that_cannot_fail_or_cannot_succeed(predict, want):
    calls = []
    acc = ev.score_passkey(predict, ENC, lengths=[256, 512], depths=[0.0, 0.5, 1.0], per_cell=3, batch_size=2,
                           progress=calls.append)
    assert acc.shape == (3, 2)
    np.testing.assert_array_equal(acc, np.full((3, 2), want))
    assert sum(calls) == 3 * 2 * 3 and len(calls) == 2 * 5  # each length's 9 examples in 5 batches of 2


def test_passkey_score_counts_each_example():
    state = {"n": 0}

    def every_other(batch):  # right on even examples, wrong on odd ones
        out = _oracle(batch)
        for i in range(len(out)):
            if (state["n"] + i) % 2:
                out[i, -1] = 48 + (out[i, -1] - 48 + 1) % 10
        state["n"] += len(out)
        return out

    acc = ev.score_passkey(every_other, ENC, lengths=[256], depths=[0.5], per_cell=4, batch_size=2)
    assert acc[0, 0] == 0.5


# ----------------------------------------------------------------------------------------------
# The train-loop hook and the CLI.


@pytest.mark.slow
def test_training_validates_and_the_cli_evaluates_the_run(tmp_path, capsys, monkeypatch):
    from jaxlong.eval import __main__ as eval_cli
    from jaxlong.recipes import train as run

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "seq_len=128", "global_batch=4", "grad_accum=2",
                   "data.max_tokens=200000", "model.vocab_size=257", "steps=3", "eval_every=2", "eval_batches=2",
                   "eval_fraction=0.2", "checkpoint_every=3", "run_name=r", f"run_dir={tmp_path}",
                   "ruler_tasks=[niah_single_1]", "ruler_lengths=[512]", "ruler_cases=2")
    run(cfg)
    out = capsys.readouterr().out
    assert "eval step, per device (compiled memory_analysis)" in out
    assert "step 2: ruler (generate) niah_single_1@512 " in out and "step 3: ruler (generate) niah_single_1@512 " in out
    run_dir = tmp_path / "r"
    events = EventAccumulator(str(run_dir)).Reload()
    assert [e.step for e in events.Scalars("eval/ruler_generate/niah_single_1/00000512")] == [2, 3]
    assert [e.step for e in events.Scalars("eval/ruler_generate/mean")] == [2, 3]
    evals = events.Scalars("eval/loss")
    assert [e.step for e in evals] == [2, 3]  # every 2 steps and after the last
    assert all(np.isfinite(e.value) for e in evals)
    ppl = events.Scalars("eval/perplexity")
    np.testing.assert_allclose([p.value for p in ppl], np.exp([e.value for e in evals]), rtol=1e-5)

    code = eval_cli.main([str(run_dir), "--lengths", "128,256", "--depths", "0,1", "--per-cell", "2", "--ruler",
                          "--ruler-tasks", "niah_single_1,niah_single_2", "--ruler-lengths", "512",
                          "--ruler-cases", "3"])
    assert code == 0
    # the progress bar counts 2 batches of 2 validation sequences once each, and 2 x 2 cells of 2 passkey examples
    out, err = capsys.readouterr()
    assert "| 12/12 [" in err and "| 6/6 [" in err  # and the 2 x 3 RULER cases
    assert "RULER by greedy generation, RULER's string_match_all" in out
    assert "RULER             512\nniah_single_1     " in out and "niah_single_2     " in out
    (res,) = (run_dir / "eval").glob("mesh_1x2x1x4-*/step_3")  # the run's mesh; flags not at their defaults
    summary = json.loads((res / "summary.json").read_text())
    assert summary["setup"]["mesh"] == {"data": 1, "fsdp": 2, "ring": 1, "context": 4}
    np.testing.assert_allclose(summary["loss"], evals[-1].value, rtol=1e-5)  # the trainer's own split and step
    rows = summary["loss_by_position"]
    assert rows[0]["start"] == 0 and rows[-1]["end"] == 128
    total = sum(r["loss"] * r["tokens"] for r in rows) / sum(r["tokens"] for r in rows)
    np.testing.assert_allclose(total, summary["loss"], rtol=1e-5)  # buckets partition the same tokens
    assert np.asarray(summary["passkey"]["accuracy"]).shape == (2, 2)
    for name in ("loss_by_position.csv", "loss_by_position.png", "passkey.csv", "passkey.png", "ruler.csv",
                 "ruler.png"):
        assert (res / name).stat().st_size > 0
    rl = summary["ruler"]
    assert rl["tasks"] == ["niah_single_1", "niah_single_2"] and rl["lengths"] == [512] and rl["skipped"] == []
    assert rl["scoring"] == "generate" and summary["setup"]["flags"]["ruler_scoring"] == "generate"
    assert [(r["task"], r["length"], r["cases"]) for r in rl["rows"]] == [("niah_single_1", 512, 3),
                                                                          ("niah_single_2", 512, 3)]
    assert (res / "ruler.csv").read_text().startswith(
        "task,length,cases,correct,score\nniah_single_1,512,3,")
    with open(res / "ruler_cases.csv") as f:  # each case: what the model generated, agreeing with the scores
        cases = list(csv.DictReader(f))
    assert [(c["task"], c["index"]) for c in cases] == [(t, str(i)) for t in rl["tasks"] for i in range(3)]
    for c in cases:  # RULER's string_match_all of the generated text, RULER's 128 tokens at most
        assert float(c["score"]) == ruler.string_match_all(c["generated"], [c["answer"]])
        assert int(c["prompt_tokens"]) + 128 <= 512 and c["stopped"] in ("eos", "length")
    assert [sum(float(c["score"]) for c in cases if c["task"] == r["task"]) for r in rl["rows"]] == \
        pytest.approx([r["correct"] for r in rl["rows"]])
    assert all(c["answer"].strip().isdigit() and 0 <= float(c["depth"]) <= 1 for c in cases)
    tags = EventAccumulator(str(res.parent)).Reload().Tags()["scalars"]
    assert {"eval/passkey_accuracy", "eval/ruler_generate/niah_single_2/00000512", "eval/ruler_generate/mean"} \
        <= set(tags)
    # the teacher-forced proxy: its own setup directory and tags, exact matches counted per case; the host-memory
    # guard says what it estimated for a length it compiled for (from 64K tokens; here from 256)
    from jaxlong.evaluation import hostmem

    monkeypatch.setattr(hostmem, "LONG", 256)
    assert eval_cli.main([str(run_dir), "--no-passkey", "--batches", "1", "--ruler", "--ruler-scoring", "forced",
                          "--ruler-tasks", "niah_single_1", "--ruler-lengths", "384", "--ruler-cases", "2"]) == 0
    out = capsys.readouterr().out
    assert "RULER teacher-forced exact match" in out
    assert re.search(r"host memory at 384 tokens: about [\d.]+ [MG]iB estimated, this host has [\d.]+ GiB \(8 CPU "
                     r"device\(s\) x [\d.]+ [KM]iB compiled, [\d.]+ [KM]?i?B over 300 kv steps per device and layer, "
                     r"[\d.]+ [KM]?i?B of host arrays, [\d.]+ [KMG]iB in use\)", out), out
    forced = [p for p in (run_dir / "eval").glob("mesh_1x2x1x4-*/step_3") if p != res]
    assert len(forced) == 1
    rf = json.loads((forced[0] / "summary.json").read_text())["ruler"]
    assert rf["scoring"] == "forced" and [(r["task"], r["length"], r["cases"]) for r in rf["rows"]] == \
        [("niah_single_1", 384, 2)]
    with open(forced[0] / "ruler_cases.csv") as f:  # the forced kind's columns: exact match, the argmax text
        fc = list(csv.DictReader(f))
    assert list(fc[0]) == list(ruler.CASE_COLUMNS) and sum(int(c["correct"]) for c in fc) == rf["rows"][0]["correct"]
    tags = EventAccumulator(str(forced[0].parent)).Reload().Tags()["scalars"]
    assert "eval/ruler_forced/niah_single_1/00000384" in tags and not any("ruler_generate" in t for t in tags)
    # the trainer's own eval/loss stays alone in the run's events: the evaluation logs to its setup's directory
    assert [e.step for e in EventAccumulator(str(run_dir)).Reload().Scalars("eval/loss")] == [2, 3]

    assert eval_cli.main([str(run_dir), "--step", "7"]) == 2
    assert "no checkpoint at that step" in capsys.readouterr().err
    assert eval_cli.main([str(tmp_path / "missing")]) == 2
    assert eval_cli.main([str(run_dir), "--lengths", "130"]) == 2


@pytest.mark.slow
def test_the_cli_evaluates_a_ring_run_like_a_mesh_without_ring(tmp_path, capsys):
    """A run trained with ring attention: `python -m jaxlong.eval` on its own mesh (ring 2 x context 4) and on
    fsdp 2 x context 4 writes the same validation loss, loss by position and passkey scores, each evaluation in
    its own directory with its own TensorBoard events (neither overwrites the other's, and no tag is logged
    twice at a step)."""
    import csv

    from jaxlong.eval import __main__ as eval_cli
    from jaxlong.recipes import train as run

    run(tiny_cfg("model.vocab_size=257", "seq_len=128", "global_batch=2", "mesh.fsdp=1", "mesh.ring=2",
                 "mesh.context=4", "data.max_tokens=100000", "steps=2", "eval_every=2", "run_name=r",
                 f"run_dir={tmp_path}"))
    run_dir, results = tmp_path / "r", {}
    for name, mesh in (("ring", []), ("no-ring", ["mesh.ring=1", "mesh.fsdp=2"])):
        assert eval_cli.main([str(run_dir), "--lengths", "128", "--depths", "0,1", "--per-cell", "2", *mesh]) == 0
    for name, axes in (("ring", "1x1x2x4"), ("no-ring", "1x2x1x4")):
        (out,) = (run_dir / "eval").glob(f"mesh_{axes}-*/step_2")
        with open(out / "loss_by_position.csv") as f:
            rows = list(csv.DictReader(f))
        results[name] = (json.loads((out / "summary.json").read_text()), rows)
        losses = EventAccumulator(str(out.parent)).Reload().Scalars("eval/loss")
        assert [e.step for e in losses] == [2] and losses[0].value == pytest.approx(results[name][0]["loss"], rel=1e-6)
    (ring, ring_rows), (plain, plain_rows) = results["ring"], results["no-ring"]
    assert ring["setup"]["overrides"] == [] and plain["setup"]["overrides"] == ["mesh.ring=1", "mesh.fsdp=2"]
    np.testing.assert_allclose(ring["loss"], plain["loss"], rtol=1e-5)
    assert [r["tokens"] for r in ring_rows] == [r["tokens"] for r in plain_rows]
    np.testing.assert_allclose([float(r["loss"]) for r in ring_rows], [float(r["loss"]) for r in plain_rows],
                               rtol=1e-5)
    assert ring["passkey"]["accuracy"] == plain["passkey"]["accuracy"]
    assert [e.step for e in EventAccumulator(str(run_dir)).Reload().Scalars("eval/loss")] == [2]  # the trainer's


def _fake_checkpoint(run_dir, step: int, cfg) -> None:
    """A checkpoint directory holding only `cfg` (what `python -m jaxlong.eval` reads before restoring)."""
    from jaxlong.config import to_dict

    (run_dir / "checkpoints" / str(step) / "config").mkdir(parents=True)
    (run_dir / "checkpoints" / str(step) / "config" / "metadata").write_text(json.dumps(to_dict(cfg)))
    (run_dir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").write_text("{}")


def test_passkey_lengths_hold_the_prompt(tmp_path, capsys):
    """A 64-token run: the default passkey length (64) cannot hold the prompt (101 byte tokens), so the passkey
    test is left out with a note instead of failing after the validation pass; a short `--lengths` is refused."""
    from jaxlong.config import ConfigError
    from jaxlong.eval import __main__ as eval_cli

    _fake_checkpoint(tmp_path, 3, tiny_cfg("mesh.fsdp=2", "mesh.context=4"))
    shortest = ev.passkey_min_length(ENC, 5)
    assert shortest == 101

    def lengths(*argv):
        args = eval_cli.parse_args([str(tmp_path), *argv])
        _, _, cfg = evaluation.resolve(args.run_dir, args)
        return evaluation.passkey_lengths(cfg, args, ByteTokenizer())

    assert lengths() == [] and "note: no passkey retrieval: seq_len 64 cannot hold" in capsys.readouterr().out
    assert lengths("--lengths", "128,256") == [128, 256]
    with pytest.raises(ConfigError, match="--lengths 64: a passkey length must hold the needle and the question, 101"):
        lengths("--lengths", "64,128")
    ev.passkey_example(ENC, shortest, 0.5, "99999")  # the shortest length holds it
    with pytest.raises(ValueError, match="too short"):
        ev.passkey_example(ENC, shortest - 1, 0.5, "99999")


def test_each_evaluation_setup_has_its_own_directory(tmp_path):
    """`RUN_DIR/eval/<setup>/`: named by the mesh, with a hash when other keys or flags differ from the run's;
    the same setup has the same name (a rerun replaces its own results), another setup another name."""
    from jaxlong.eval import __main__ as eval_cli

    _fake_checkpoint(tmp_path, 3, tiny_cfg("mesh.fsdp=2", "mesh.context=4"))

    def name(*argv):
        args = eval_cli.parse_args([str(tmp_path), *argv])
        cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", *args.overrides)
        shape = dict(zip(("data", "fsdp", "ring", "context"), resolve_mesh_shape(cfg.mesh, 8)))
        return evaluation.evaluation_setup(cfg, tmp_path, 3, shape, args)["name"]

    assert name() == name() == "mesh_1x2x1x4"
    assert name("mesh.fsdp=1", "mesh.context=8") == "mesh_1x1x1x8"
    names = {name(), name("mesh.fsdp=1", "mesh.context=8"), name("--per-cell", "8"), name("--lengths", "128"),
             name("--no-passkey"), name("attention.impl=upipe"), name("--batches", "4")}
    assert len(names) == 7
    assert name("--batches", "4").startswith("mesh_1x2x1x4-") and name("--batches", "4") == name("--batches=4")


def test_the_summary_says_when_passkey_retrieval_is_at_chance_level():
    from jaxlong.evaluation.report import format_summary

    rows = [{"start": 0, "end": 8, "tokens": 8, "loss": 2.0}]
    pk = {"lengths": [128], "depths": [0.0, 1.0], "accuracy": [[0.0], [0.0]], "mean": 0.0, "per_cell": 2, "digits": 5}
    low = format_summary({"step": 3, "loss": 2.0, "perplexity": 7.4, "tokens": 8, "loss_by_position": rows,
                          "passkey": pk})
    assert "passkey retrieval is at chance level (guessing all 5 digits: 1e-05)" in low
    assert "model.from_hf" in low and "experiments/passkey.py" in low
    high = format_summary({"step": 3, "loss": 2.0, "perplexity": 7.4, "tokens": 8, "loss_by_position": rows,
                           "passkey": {**pk, "accuracy": [[1.0], [0.5]], "mean": 0.75}})
    assert "chance level" not in high


def test_ruler_flags_are_checked_before_anything_compiles(tmp_path, capsys):
    """`--ruler`: tasks and lengths are checked on the checkpoint's config before jax starts; a length the mesh
    cannot take is refused in one line (exit 2) — the fake checkpoint has no parameters, so reaching the restore or
    a compile would fail otherwise. Default lengths are those of S/8..S the mesh takes."""
    from jaxlong.config import ConfigError
    from jaxlong.eval import __main__ as eval_cli
    from jaxlong.evaluation import ruler

    _fake_checkpoint(tmp_path, 3, tiny_cfg("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "seq_len=1024"))

    def resolved(*argv):
        args = eval_cli.parse_args([str(tmp_path), *argv])
        evaluation.resolve(args.run_dir, args)
        return args

    args = resolved("--ruler")
    assert args.ruler_tasks_list == list(ruler.TASKS) and args.ruler_lengths_list == [128, 256, 512, 1024]
    args = resolved("--ruler", "--ruler-tasks", "vt,niah_single_1", "--ruler-lengths", "2048,512")
    assert args.ruler_tasks_list == ["vt", "niah_single_1"] and args.ruler_lengths_list == [512, 2048]
    for argv, match in ((["--ruler-lengths", "1000"], "--ruler-lengths 1000: not a sequence length this mesh takes "
                                                       "\\(.*2\\*mesh.ring\\*mesh.context"),
                        (["--ruler-tasks", "niah,vt"], "--ruler-tasks niah,vt: unknown task\\(s\\) niah; choose from "
                                                       "niah_single_1"),
                        (["--ruler-cases", "0"], "--ruler-cases=0 must be positive"),
                        (["--ruler-lengths", "4k"], "--ruler-lengths '4k': give comma-separated token counts")):
        with pytest.raises(ConfigError, match=match):
            resolved("--ruler", *argv)
    with pytest.raises(ConfigError, match="take effect with --ruler"):
        resolved("--ruler-tasks", "vt")
    capsys.readouterr()
    assert eval_cli.main([str(tmp_path), "--ruler", "--ruler-lengths", "512,1000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ruler-lengths 1000: not a sequence length this mesh takes") and err.count("\n") == 1


def test_every_ruler_length_is_checked_and_every_problem_named_before_a_case_is_generated(tmp_path, capsys,
                                                                                         monkeypatch):
    """A list of RULER lengths with several problems is refused in one line that names each: a length that is not
    positive, one the mesh cannot split (with the nearest lengths it takes, each of which it does take), and one
    whose cases alone would exceed this host's memory (10^8 tokens: generating it grew past 5 GB before). Nothing
    is generated: case generation fails the test if reached."""
    from jaxlong.config import ConfigError
    from jaxlong.eval import __main__ as eval_cli
    from jaxlong.evaluation import ruler
    from jaxlong.evaluation.ruler import score, tasks

    cfg = tiny_cfg("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "seq_len=1024", "attention.block_q=64")
    _fake_checkpoint(tmp_path, 3, cfg)

    def never(*a, **k):
        raise AssertionError("a case was generated")

    for module in (tasks, score, ruler, eval_cli):
        for name in ("make_cases", "corpus_tokens", "generate"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, never)
    assert eval_cli.main([str(tmp_path), "--ruler", "--ruler-lengths", "512,0,1000,100000000,2048"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --ruler-lengths 0: a length must be a positive token "
                                                    "count; --ruler-lengths 1000: not a sequence length this mesh "
                                                    "takes ("), err
    assert "--ruler-lengths 100000000: 100000000 tokens need at least " in err and "of host memory" in err
    assert "--ruler-lengths 512" not in err and "--ruler-lengths 2048" not in err  # the good ones pass
    near = [int(n) for n in err.split("nearby lengths it takes: ")[1].split(";")[0].split(" or ")]
    assert len(near) == 2 and near[0] < 1000 < near[1], near
    for n in near:  # each suggestion is taken, and none is taken between them and 1000
        ruler.check_length(cfg, n)
    for n in range(near[0] + 1, near[1]):
        if n != 1000:
            with pytest.raises(ConfigError):
                ruler.check_length(cfg, n)


def test_training_refuses_a_ruler_length_the_mesh_cannot_take_before_compiling(tmp_path, capsys):
    from jaxlong.config import ConfigError
    from jaxlong.recipes import train as run

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "seq_len=128", "model.vocab_size=257", "data.max_tokens=50000",
                   "eval_fraction=0.2", "ruler_tasks=[niah_single_1]", "ruler_lengths=[512, 514]", "run_name=r",
                   f"run_dir={tmp_path}")
    with pytest.raises(ConfigError, match="^ruler_lengths 514: not a sequence length this mesh takes .*mesh.context=4"):
        run(cfg)
    with pytest.raises(ConfigError, match="ruler_tasks=\\['niah_single_1', 'nope'\\]: unknown task\\(s\\) 'nope'; "
                                          "choose from niah_single_1, niah_single_2"):
        run(dataclasses.replace(cfg, ruler_tasks=["niah_single_1", "nope"], ruler_lengths=[512]))
    assert "compiled" not in capsys.readouterr().out
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_ruler_pairs_too_short_for_a_task_are_skipped_by_default_and_refused_when_asked(tmp_path):
    """Default lengths: a (task, length) pair too short for the task is left out with a note; a `--ruler-lengths`
    length too short for a task is refused, naming the flag, the length and the shortest that works."""
    from jaxlong.config import ConfigError
    from jaxlong.eval import __main__ as eval_cli

    cfg = tiny_cfg("mesh.fsdp=2", "mesh.context=4", "seq_len=512", "model.vocab_size=257")
    _fake_checkpoint(tmp_path, 3, cfg)

    def suite(*argv):
        args = eval_cli.parse_args([str(tmp_path), "--ruler", "--ruler-cases", "2", *argv])
        _, _, cfg = evaluation.resolve(args.run_dir, args)
        return evaluation.ruler_suite(cfg, args, ByteTokenizer(), TEXTS, range(len(TEXTS)))

    cases, notes = suite("--ruler-tasks", "niah_single_1,niah_single_2")
    assert {(c.task, c.length) for c in cases} == {("niah_single_1", 512), ("niah_single_2", 512)}
    assert len(cases) == 4 and len(notes) == 6  # 64, 128, 256 too short for both
    assert notes[0].startswith("note: RULER niah_single_1 skipped at 64 tokens (") and "use at least" in notes[0]
    with pytest.raises(ConfigError, match="--ruler-lengths 256: ruler task vt: length 256 cannot hold its template.*"
                                          "use at least"):
        suite("--ruler-tasks", "vt", "--ruler-lengths", "256,512")


def test_a_split_the_evaluation_cannot_make_names_the_evaluations_own_options():
    """A corpus too small for the held-out batches: the trainer's refusal names its keys (`eval_batches`,
    `eval_every=0`), the evaluation's names its flags (`--batches`, `--batches 0`), never the other's."""
    cfg, tok = tiny_cfg("model.vocab_size=257", "eval_batches=40"), ByteTokenizer()
    with pytest.raises(ValueError, match=r"eval_batches=40: .* lower eval_batches or seq_len, .* or eval_every=0$"):
        heldout.validation_split(cfg, TEXTS, tok)
    with pytest.raises(ValueError, match=r"--batches 40: .* lower --batches or seq_len, .* or --batches 0$") as e:
        heldout.validation_split(cfg, TEXTS, tok, options=heldout.EVALUATION)
    assert "eval_every" not in str(e.value)
    with pytest.raises(ValueError, match=r"or --batches 0 to evaluate without validation batches\)"):
        heldout.held_out_documents(TEXTS[:1], tok, 0.1, seed=0, options=heldout.EVALUATION)
    args = evaluation.EvalOptions(batches=0, passkey=False)
    evaluation.check_flags(tiny_cfg(), args)  # --batches 0: no validation loss, RULER and passkey need none
    with pytest.raises(ValueError, match=r"--batches=-1 must be >= 0; use --batches 2 .* or --batches 0"):
        evaluation.check_flags(tiny_cfg(), evaluation.EvalOptions(batches=-1))


@pytest.mark.slow
def test_ruler_on_a_run_trained_on_a_small_chat_file_needs_no_validation_batches(tmp_path, capsys):
    """An SFT run of 8 short conversations (`eval_every=0`): their held-out batches cannot be made, and the refusal
    names the evaluation's own flag; with `--batches 0` RULER runs, and the summary has no validation loss."""
    from jaxlong.eval import __main__ as eval_cli  # noqa: PLC0415
    from jaxlong.recipes import train  # noqa: PLC0415

    chats = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
             for i in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                                      "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    train(tiny_cfg("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "model.vocab_size=257", "seq_len=128",
                   f"data.path={tmp_path / 'chat.jsonl'}", "data.format=chat", f"data.chat_template={tmp_path / 't.jinja'}",
                   "steps=1", "eval_every=0", "checkpoint_every=1", "run_name=sft", f"run_dir={tmp_path}"))
    ruler_args = ["--no-passkey", "--ruler", "--ruler-scoring", "forced", "--ruler-tasks", "niah_single_1",
                  "--ruler-lengths", "384", "--ruler-cases", "1"]
    capsys.readouterr()
    assert eval_cli.main([str(tmp_path / "sft"), *ruler_args]) == 2
    err = capsys.readouterr().err
    assert "--batches" in err and "eval_every" not in err
    assert eval_cli.main([str(tmp_path / "sft"), "--batches", "0", *ruler_args]) == 0
    out = capsys.readouterr().out
    assert "no validation loss (--batches 0)" in out and "RULER teacher-forced" in out
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "sft" / "eval").glob("*/step_1/summary.json")]
    assert summary["loss"] is None and summary["ruler"]["rows"][0]["task"] == "niah_single_1"

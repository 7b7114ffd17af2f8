"""RULER tasks: generation (exact length, one correct answer, determinism, needle depths) for each family on the
byte-level tokenizer and a Hugging Face tokenizer.json; teacher-forced scoring that can pass and fail; scores on
every context-parallel mesh equal one device's; the results writers."""

from __future__ import annotations

import collections
import dataclasses
import csv
import functools
import json
import re
import types
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxlong.config import ConfigError
from jaxlong.data.tokenizer import ByteTokenizer, HFTokenizer
from jaxlong.evaluation import ruler
from jaxlong.evaluation import steps as ev_steps
from jaxlong.evaluation.probes import passkey_batch
from jaxlong.evaluation.ruler.words import Pieces
from jaxlong.config import runtime
from jaxlong.models.llama import forward, model_graphdef
from jaxlong.training import step as step_lib
from tests.helpers import mesh_for, tiered, tiny_cfg

HF_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "hf"
TOKENIZERS = {"byte": ByteTokenizer, "hf": lambda: HFTokenizer(HF_DIR / "llama31")}


@functools.lru_cache(maxsize=None)
def _tokenizer(name):
    return TOKENIZERS[name]()


def _task(name, tok):
    """RULER's configuration; on the fixture tokenizer (no digits in its vocabulary) words for numbers/uuids."""
    t = ruler.TASKS[name]
    if tok == "hf":
        t = dataclasses.replace(t, keys="words", values="words")
    return t


@functools.lru_cache(maxsize=None)
def _corpus(tok):
    return ruler.corpus_tokens([(HF_DIR / "corpus.txt").read_text()], _tokenizer(tok))


@functools.lru_cache(maxsize=None)
def _cases(name, tok, length=4096, n=5, seed=0):
    return ruler.make_cases(_task(name, tok), _tokenizer(tok), length, n, seed=seed, corpus=_corpus(tok))


def _count(seq, sub):
    win = np.lib.stride_tricks.sliding_window_view(seq, sub.size)
    return int(np.all(win == sub, axis=1).sum())


NEEDLE_RE = re.compile(r"for ([0-9a-z-]+) is:? ([0-9a-z-]+)\.")
VT_RE = re.compile(r"V?AR ([A-Z]{5}) =? ?(?:V?AR ([A-Z]{5})|([0-9a-z-]+))\.")


def _solve(case, tok):
    """The answer read back from the decoded context by the task's own rule, independently of the generator:
    it must equal the case's items, and be the only answer the input supports."""
    t = ruler.TASKS[case.task]
    s, e = case.context
    text = _tokenizer(tok).decode(case.tokens[s:e])
    if t.family == "niah":
        pairs = NEEDLE_RE.findall(text)
        found = [(k, v) for k, v in pairs if k in case.query]
        assert len(found) == t.num_values * t.num_queries  # each asked key in exactly its needles
        assert not set(case.distractors) & set(case.items)
        if t.num_values > 1:
            return [v for _, v in found]  # in order of appearance
        return [v for q in case.query for k, v in found if k == q]  # in the order asked
    if t.family == "vt":
        assign = collections.defaultdict(list)
        for var, prev, value in VT_RE.findall(text):
            assign[var].append(prev or value)
        assert all(len(v) == 1 for v in assign.values())  # each variable assigned once
        chain, target = [], case.query[0]
        while True:
            nxt = [var for var, (rhs,) in assign.items() if rhs == target]
            assert len(nxt) <= 1
            if not nxt:
                return chain
            chain.append(nxt[0])
            target = nxt[0]
    words = re.findall(r"[a-z][a-z-]*", text)
    counts = collections.Counter(words)
    ranked = counts.most_common()
    if t.family == "cwe":
        common = [w for w, c in ranked if c == t.freq_common]
        assert len(common) == t.num_common and all(c <= t.freq_rare for _, c in ranked[t.num_common:])
        return sorted(common, key=words.index)  # in order of first appearance
    top = [c for _, c in ranked[: t.top + 1]]
    assert all(a > b for a, b in zip(top, top[1:]))  # a strict top, and the next word below it
    return [w for w, _ in ranked[: t.top]]


ALL = list(ruler.TASKS)


@pytest.mark.parametrize("tok", list(TOKENIZERS))
@pytest.mark.parametrize("name", ALL)
def test_each_case_has_the_exact_length_and_one_answer_read_back_from_its_input(name, tok):
    pieces = Pieces(_tokenizer(tok))
    for c in _cases(name, tok):
        assert c.tokens.shape == (4097,) and c.tokens.dtype == np.int32
        np.testing.assert_array_equal(c.answer, np.arange(4096 - c.answer.size, 4096))  # the last targets
        np.testing.assert_array_equal(c.tokens[1:][c.answer], pieces.join(c.items))
        assert _solve(c, tok) == list(c.items)
        inputs = c.tokens[:-1]
        for item, at in zip(c.items, c.item_starts, strict=True):  # the answer's tokens are in the input
            slot = pieces.slot(item)
            np.testing.assert_array_equal(inputs[at:at + slot.size], slot)
            if ruler.TASKS[c.task].family == "niah":
                assert _count(c.tokens[:-c.answer.size], slot) == 1  # before the answer, once: in its needle
        if _tokenizer(tok).bos_id is not None:
            assert c.tokens[0] == _tokenizer(tok).bos_id


@pytest.mark.parametrize("tok", list(TOKENIZERS))
@pytest.mark.parametrize("name", ALL)
def test_cases_are_identical_for_a_seed_and_the_needles_cover_the_input(name, tok):
    again = ruler.make_cases(_task(name, tok), _tokenizer(tok), 4096, 5, seed=0, corpus=_corpus(tok))
    other = ruler.make_cases(_task(name, tok), _tokenizer(tok), 4096, 5, seed=1, corpus=_corpus(tok))
    for a, b, c in zip(_cases(name, tok), again, other, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        assert a.items == b.items and a.depths == b.depths
        assert not np.array_equal(a.tokens, c.tokens)
    if ruler.TASKS[name].family not in ("niah", "vt"):
        return
    depths = np.concatenate([c.depths for c in _cases(name, tok)])
    first = [c.depths[0] for c in _cases(name, tok)]
    assert first[0] < 0.15 and first[-1] > (0.85 if ruler.TASKS[name].family == "niah" else 0.45)
    assert np.all(np.diff(first) > 0)  # the asked needle moves through the input case by case
    assert np.histogram(depths, bins=4, range=(0, 1))[0].min() > 0  # every quarter holds an answer needle


def test_refusals_name_the_problem():
    byte, hf = _tokenizer("byte"), _tokenizer("hf")
    with pytest.raises(ValueError, match=r"niah_single_1: length 100 is too short .* at least \d+ tokens"):
        ruler.make_cases("niah_single_1", byte, 100, 1)
    with pytest.raises(ValueError, match=r"cwe: length 1024 is too short"):
        ruler.make_cases("cwe", byte, 1024, 1)
    with pytest.raises(ValueError, match="cannot spell digits.*'words'"):
        ruler.make_cases("niah_single_1", hf, 4096, 1)
    with pytest.raises(ValueError, match="needs the run's corpus"):
        ruler.make_cases("niah_single_2", byte, 4096, 1)
    with pytest.raises(ValueError, match="unknown"):
        ruler.make_cases("qa_1", byte, 4096, 1)
    with pytest.raises(ValueError, match="freq_common=3 must exceed freq_rare=3"):
        ruler.make_cases(dataclasses.replace(ruler.TASKS["cwe"], freq_common=3), byte, 4096, 1)
    ring = tiny_cfg("global_batch=4", "mesh.fsdp=4", "mesh.ring=2", "mesh.context=1")
    with pytest.raises(ConfigError, match=r"^ruler length 1020: not a sequence length this mesh takes \(.*\)$"):
        ruler.check_length(ring, 1020)
    ruler.check_length(ring, 1024)


# ----------------------------------------------------------------------------------------------
# Scoring: it can pass and it can fail, per family.

FAMILY_CASES = {"niah": "niah_multivalue", "vt": "vt", "cwe": "cwe", "fwe": "fwe"}


def _copier(cases):
    """Handed the answer: copies each item's tokens from where the case put it in the input (its needle or its
    first list entry) and joins them with the separator; every other position predicts the true next token."""
    pieces = Pieces(_tokenizer("byte"))
    by_tokens = {c.tokens[:-1].tobytes(): c for c in cases}

    def predict(batch):
        out = batch["targets"].copy()
        for row, inp in zip(out, batch["inputs"]):
            c = by_tokens[inp.tobytes()]
            parts = []
            for k, (item, at) in enumerate(zip(c.items, c.item_starts)):
                parts += [pieces(",")] if k else []
                parts.append(inp[at:at + pieces.slot(item).size])
            row[c.answer] = np.concatenate(parts)
        return out

    return predict


def _random(seed):
    rng = np.random.default_rng(seed)
    return lambda batch: rng.integers(0, 257, batch["targets"].shape)


def _one_token_wrong(cases):
    copy = _copier(cases)

    def predict(batch):
        out = copy(batch)
        out[:, -2] = (out[:, -2] + 1) % 257  # the answer's second-to-last token
        return out

    return predict


@pytest.mark.parametrize("family", list(FAMILY_CASES))
def test_the_score_of_a_model_handed_the_answer_is_one_and_of_a_random_model_chance(family):
    cases = [c for n in (4096, 8192) for c in _cases(FAMILY_CASES[family], "byte", n, 3)]
    calls = []
    right = ruler.score_cases(_copier(cases), cases, batch_size=2, progress=calls.append)
    assert right.all() and sum(calls) == len(cases) and len(calls) == 4  # 3 cases per length: 2 + 1 (padded)
    rows = ruler.results(cases, right)
    assert [(r["length"], r["cases"], r["score"]) for r in rows] == [(4096, 3, 1.0), (8192, 3, 1.0)]
    # chance: all of an answer's tokens guessed, 257 ** -len(answer) <= 257 ** -5 per case
    assert min(c.answer.size for c in cases) >= 5
    assert not ruler.score_cases(_random(0), cases, batch_size=2).any()
    assert not ruler.score_cases(_one_token_wrong(cases), cases, batch_size=2).any()


def test_the_score_counts_each_case():
    cases = _cases("niah_single_1", "byte")
    copy, state = _copier(cases), {"n": 0}

    def every_other(batch):
        out = copy(batch)
        for i in range(len(out)):
            if (state["n"] + i) % 2:
                out[i, -1] = (out[i, -1] + 1) % 257
        state["n"] += len(out)
        return out

    right = ruler.score_cases(every_other, cases, batch_size=5)
    np.testing.assert_array_equal(right, [True, False, True, False, True])
    assert ruler.results(cases, right)[0]["score"] == 0.6


# ----------------------------------------------------------------------------------------------
# On the training mesh: every context-parallel mesh scores like one device.

MESHES = {
    "ulysses": ("mesh.fsdp=2", "mesh.context=4"),
    "upipe": ("mesh.fsdp=2", "mesh.context=4", "attention.impl=upipe", "attention.heads_per_stage=4"),
    "ring": ("mesh.fsdp=4", "mesh.ring=2", "mesh.context=1"),
    "ulysses-ring": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4"),
}
LENGTH = 384
SMALL = {  # RULER's families at a length a CPU test affords
    "niah_single_1": {}, "vt": {"hops": 1}, "cwe": {"num_common": 2, "freq_common": 3, "freq_rare": 1},
    "fwe": {"top": 2},
}


def _mesh_cfg(*mesh):
    return tiny_cfg("model.vocab_size=257", "global_batch=4", f"seq_len={LENGTH}", *mesh)


@functools.lru_cache(maxsize=None)
def _greedy_cases():
    """One case per family, and a copy of each whose answer is the one-device model's own greedy answer: that
    copy scores 1 on one device and the generated case 0, so a mesh that scores them alike takes the same
    argmax at every answer token. Returns the one-device parameters, the 8 cases, their one-device scores, the
    one-device argmax `[8, S]` and the two best logits' margin `[8, S]`."""
    ref = _mesh_cfg("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1", "attention.backend=reference",
                    "remat.policy=none")  # tests.helpers.reference_cfg, with blocks that divide LENGTH
    mesh = mesh_for(ref, 1)
    params = step_lib.init_state(ref, mesh)["params"]
    cases = [ruler.make_cases(dataclasses.replace(ruler.TASKS[t], **o), _tokenizer("byte"), LENGTH, 1, seed=3)[0]
             for t, o in SMALL.items()]
    logits_fn = jax.jit(lambda p, x: jax.numpy.einsum("bsh,hv->bsv", *forward(
        model_graphdef(ref.model, ref.param_dtype), p, x, runtime(ref, mesh))))
    tokens = np.stack([c.tokens for c in cases])
    for _ in range(max(c.answer.size for c in cases)):  # greedy: the answer's tokens one at a time
        argmax = np.asarray(logits_fn(params, tokens[:, :-1])).argmax(-1)
        new = tokens.copy()
        for i, c in enumerate(cases):
            new[i, c.answer + 1] = argmax[i, c.answer]
        if np.array_equal(new, tokens):
            break
        tokens = new
    both = cases + [ruler.RulerCase(**{**c.__dict__, "tokens": tokens[i]}) for i, c in enumerate(cases)]
    logits = np.asarray(logits_fn(params, passkey_batch(both)["inputs"]))
    argmax = logits.argmax(-1)
    top2 = np.sort(logits, axis=-1)[..., -2:]
    want = ruler.score_on_mesh(ref, mesh, params, both)
    return jax.tree.map(np.asarray, params), both, want, argmax, top2[..., 1] - top2[..., 0]


def test_one_device_scores_its_own_greedy_answers_and_not_the_generated_ones():
    _, both, want, _, margin = _greedy_cases()
    np.testing.assert_array_equal(want, [False] * 4 + [True] * 4)
    clear = [bool((margin[i, c.answer] > 1e-4).all()) for i, c in enumerate(both)]
    assert sum(clear) >= 6  # few float32 near-ties at answer tokens


@pytest.mark.parametrize(*tiered("mesh", list(MESHES), fast=["upipe", "ulysses-ring"], ids=list(MESHES)))
def test_scores_on_every_mesh_equal_one_device(mesh):
    """Scores and the answers' argmax on each mesh equal one device's wherever the two best logits differ by
    more than 1e-4 (a case with a near-tie at an answer token may score either way)."""
    params1, both, want, want_argmax, margin = _greedy_cases()
    cfg = _mesh_cfg(*MESHES[mesh])
    m = mesh_for(cfg, 8)
    params = jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), params1,
                          step_lib.abstract_state(cfg, m)["params"])
    stats = ev_steps.token_stats(cfg, m)
    got = ruler.score_on_mesh(cfg, m, params, both, stats=stats)
    argmax = np.concatenate([stats(params, passkey_batch(both[k:k + 4]))[1] for k in (0, 4)])
    for i, c in enumerate(both):
        clear = margin[i, c.answer] > 1e-4
        np.testing.assert_array_equal(argmax[i, c.answer][clear], want_argmax[i, c.answer][clear])
        if clear.all():
            assert got[i] == want[i], (mesh, c.task)
    if mesh == "ulysses-ring":  # the whole path: checks, generation, scores (a random model: chance, 0), rows
        suite = ruler.RulerSuite(tasks=[dataclasses.replace(ruler.TASKS[t], **o) for t, o in SMALL.items()],
                                 lengths=[LENGTH], cases=2, seed=0, scoring="forced")
        rows = ruler.evaluate_ruler(cfg, m, params, _tokenizer("byte"), suite, stats=stats)
        assert [(r["task"], r["cases"], r["correct"]) for r in rows] == [(t, 2, 0) for t in SMALL]
        during_training = ruler.RulerValidator(cfg, m, _tokenizer("byte"), suite)  # cases made once
        during_training.stats = stats  # what the trainer shares with its other per-token evaluation
        assert during_training.run(params) == rows and len(during_training.cases) == 2 * len(SMALL)
        with pytest.raises(ConfigError, match="ruler length 500"):
            ruler.evaluate_ruler(cfg, m, params, _tokenizer("byte"), ruler.RulerSuite(lengths=[500], scoring="forced"))


def test_ruler_by_generation_during_training_compiles_once():
    """RULER by generation as the trainer runs it (one device): RULER's prompts at 512 tokens, RULER's 128 new
    tokens, scored by string_match_all; a second validation reuses the first's compiled decode step and gives the
    same texts."""
    params1, *_ = _greedy_cases()
    cfg = _mesh_cfg("mesh.fsdp=1", "mesh.context=1", "mesh.num_devices=1")
    m = mesh_for(cfg, 1)
    params = jax.tree.map(lambda h, a: jax.device_put(h, a.sharding), params1,
                          step_lib.abstract_state(cfg, m)["params"])
    by_generation = ruler.RulerValidator(cfg, m, _tokenizer("byte"), ruler.RulerSuite(
        tasks=["niah_single_1"], lengths=[512], cases=2, seed=0), eos_ids=[256])
    first = by_generation.run(params)
    texts = [g.text for g in by_generation.outputs]
    assert [(r["task"], r["length"], r["cases"]) for r in first] == [("niah_single_1", 512, 2)]
    assert first[0]["correct"] == sum(ruler.string_match_all(t, c.refs) for t, c in zip(texts, by_generation.cases))
    assert by_generation.run(params) == first and [g.text for g in by_generation.outputs] == texts
    (gen,) = by_generation.generators.values()
    assert gen.step._cache_size() == 1  # one decode program for both validations


# ----------------------------------------------------------------------------------------------
# Results.


class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)


def test_results_csv_heatmap_table_and_scalars(tmp_path):
    rows = [{"task": t, "length": n, "cases": 4, "correct": c, "score": c / 4}
            for t, n, c in [("niah_single_1", 4096, 4), ("niah_single_1", 1 << 20, 1), ("vt", 4096, 2)]]
    paths = ruler.write_results(tmp_path, rows)
    with open(paths[0]) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["task", "length", "cases", "correct", "score"]
    assert [(r["task"], int(r["length"]), float(r["score"])) for r in got] == \
        [("niah_single_1", 4096, 1.0), ("niah_single_1", 1048576, 0.25), ("vt", 4096, 0.5)]
    assert paths[1].read_bytes()[:4] == b"\x89PNG"
    table = ruler.format_table(rows).splitlines()
    assert table[0].split() == ["RULER", "4K", "1M"]
    assert table[1].split() == ["niah_single_1", "100.0", "25.0"]
    assert table[2].split() == ["vt", "50.0", "-"] and table[3].split() == ["mean", "75.0", "25.0"]
    w = _Writer()
    ruler.log_scalars(w, rows, step=7, prefix=ruler.tag_prefix("forced"))
    assert w.scalars["eval/ruler_forced/niah_single_1/01048576"] == (0.25, 7)
    assert w.scalars["eval/ruler_forced/niah_single_1"] == (0.625, 7)
    assert w.scalars["eval/ruler_forced/mean"] == (pytest.approx(1.75 / 3), 7)


def test_prompts_are_written_beside_the_cases_one_json_line_each(tmp_path):
    """`ruler_prompts.jsonl` holds, for each row of `ruler_cases.csv` in its order, the row's task, length, index
    and depth, and the prompt the model read: by generation RULER's whole prompt (its text and answer prefix, the
    byte tokenizer's document token not being text), teacher-forced the document up to the answer."""
    tok = _tokenizer("byte")
    made = ruler.generation_cases("niah_single_1", tok, 1024, 2) + ruler.generation_cases("fwe", tok, 512, 1)
    outputs = [types.SimpleNamespace(text=f"answer {i}", reason="eos") for i in range(len(made))]
    forced = ruler.make_cases("niah_single_1", tok, 512, 2) + ruler.make_cases("fwe", tok, 512, 1)
    argmax = [c.tokens[1:][c.answer] for c in forced]
    rows = [{"task": "niah_single_1", "length": 1024, "cases": 2, "correct": 1, "score": 0.5}]
    for kind, cases, case_rows in (
            ("generate", made, ruler.generation_case_rows(made, outputs, np.ones(len(made)))),
            ("forced", forced, ruler.case_rows(forced, argmax, ruler.is_right(forced, argmax), tok.decode))):
        out = tmp_path / kind
        paths = ruler.write_results(out, rows, cases=case_rows,
                                    prompts=ruler.report.prompt_rows(cases, tok.decode))
        assert paths[-2:] == [out / "ruler_cases.csv", out / "ruler_prompts.jsonl"]
        with open(out / "ruler_cases.csv") as f:
            csv_rows = list(csv.DictReader(f))
        *lines, last = (out / "ruler_prompts.jsonl").read_text(encoding="utf-8").split("\n")
        prompts = [json.loads(line) for line in lines]
        assert last == ""  # every line ends with a newline
        assert len(prompts) == len(csv_rows) == len(cases)
        for c, row, p in zip(cases, csv_rows, prompts):
            assert list(p) == list(ruler.report.PROMPT_FIELDS)
            assert (p["task"], str(p["length"]), str(p["index"])) == (row["task"], row["length"], row["index"])
            assert p["depth"] == (float(row["depth"]) if row["depth"] else None)
            if kind == "generate":
                assert p["prompt"] == c.text + c.answer_prefix == tok.decode(c.prompt)
            else:  # the answer's tokens follow the prompt in the document
                assert p["prompt"] + c.answer_text == tok.decode(c.tokens[:c.answer[-1] + 2])
        assert prompts[-1]["task"] == "fwe" and prompts[-1]["depth"] is None  # no needle
        assert "special magic number" in prompts[0]["prompt"]  # RULER's words, or the forced case's question


@pytest.mark.slow
def test_the_eval_command_writes_each_cases_prompt_beside_its_answer(tmp_path, capsys):
    """`python -m jaxlong.eval RUN --ruler` (a tiny run of one step, one device), by generation and teacher-forced,
    writes `ruler_prompts.jsonl` beside `ruler_cases.csv`: a prompt per row, with the row's task, length, index and
    depth, as long as the row says (by generation) and in RULER's words."""
    from jaxlong.eval import __main__ as eval_cli  # noqa: PLC0415
    from jaxlong.recipes import train as run  # noqa: PLC0415

    run(tiny_cfg("mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1", "model.vocab_size=257", "seq_len=128",
                 "data.max_tokens=100000", "steps=1", "eval_every=1", "eval_batches=1", "eval_fraction=0.2",
                 "checkpoint_every=1", "run_name=r", f"run_dir={tmp_path}"))
    tok = _tokenizer("byte")
    for scoring, length in (("generate", 512), ("forced", 384)):
        assert eval_cli.main([str(tmp_path / "r"), "--no-passkey", "--batches", "1", "--ruler", "--ruler-scoring",
                              scoring, "--ruler-tasks", "niah_single_1", "--ruler-lengths", str(length),
                              "--ruler-cases", "2"]) == 0
        capsys.readouterr()
        (out,) = [d for d in (tmp_path / "r" / "eval").glob("*/step_1")
                  if json.loads((d / "summary.json").read_text())["ruler"]["scoring"] == scoring]
        with open(out / "ruler_cases.csv") as f:
            rows = list(csv.DictReader(f))
        prompts = [json.loads(line) for line in (out / "ruler_prompts.jsonl").read_text().splitlines()]
        assert len(rows) == len(prompts) == 2
        for row, p in zip(rows, prompts):
            assert (p["task"], p["length"], p["index"], p["depth"]) == \
                (row["task"], int(row["length"]), int(row["index"]), float(row["depth"]))
            assert "special magic number" in p["prompt"] and int(p["length"]) == length
            if scoring == "generate":  # the document token, then the prompt's text byte for byte
                assert len(tok.encode(p["prompt"])) + 1 == int(row["prompt_tokens"])
                assert p["prompt"].endswith("mentioned in the provided text is")


# ----------------------------------------------------------------------------------------------
# RULER by generation: prompts and RULER's metric.


@pytest.mark.parametrize("tok", ["byte", "hf"])
def test_generation_prompts_are_rulers_templates_within_rulers_budget(tok):
    """Every task's prompt is RULER's template and answer prefix around the case's context, as text tokenized by
    the tokenizer; the prompt plus RULER's tokens_to_generate fills the length without passing it; the answer's
    items are in the text; the cases are a pure function of the seed."""
    tokenizer = _tokenizer(tok)
    for name in ruler.TASKS:
        task = _task(name, tok)
        length = 8192 if task.family == "cwe" else 4096  # cwe's 300 common entries and its example
        ttg = ruler.TOKENS_TO_GENERATE[task.family]
        cases = ruler.generation_cases(task, tokenizer, length, 3, corpus=_corpus(tok))
        assert [c.index for c in cases] == [0, 1, 2] and all(c.tokens_to_generate == ttg for c in cases)
        for c in cases:
            assert 0.97 * (length - ttg) <= c.prompt.size <= length - ttg, (name, c.prompt.size)
            assert np.array_equal(c.prompt, ruler.render_prompt(c.text, c.answer_prefix, tokenizer))
            assert all(item in c.text for item in c.refs), name
            template, prefix = ruler.TEMPLATES[task.family]
            if task.family == "vt":  # RULER's one in-context example, then the case
                assert c.text.count("Memorize and track the chain(s)") == 2
                assert c.answer_prefix == prefix.format(num_v=5, query=c.text.rsplit("the value ", 1)[1].split()[0])
            elif task.family == "cwe":
                assert c.text.count("Below is a numbered list of words.") == 2 and c.answer_prefix == prefix
            elif task.family == "fwe":
                assert c.text.startswith(template.split("{")[0]) and c.answer_prefix == prefix
        again = ruler.generation_cases(task, tokenizer, length, 3, corpus=_corpus(tok))
        assert all(np.array_equal(a.prompt, b.prompt) and a.refs == b.refs for a, b in zip(cases, again))
    single = ruler.generation_cases("niah_single_1", _tokenizer("byte"), 1024, 1)[0]
    key = single.text.rsplit("special magic number for ", 1)[1].split(" mentioned")[0]
    assert single.text.startswith("A special magic number is hidden within the following text. Make sure to "
                                  "memorize it. I will quiz you about the number afterwards.\n")
    assert single.text.endswith(f"\nWhat is the special magic number for {key} mentioned in the provided text?")
    assert single.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    multi = ruler.generation_cases("niah_multiquery", _tokenizer("byte"), 2048, 1, corpus=_corpus("byte"))[0]
    assert multi.text.startswith("Some special magic numbers are hidden") and len(multi.refs) == 4
    assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned in the provided text are$", multi.answer_prefix)
    with pytest.raises(ruler.TooShort, match="ruler task vt: length 512 cannot hold its template, its fixed parts "
                                             "and the 30 tokens RULER generates with this tokenizer; use at least "
                                             r"9\d\d tokens"):
        ruler.generation_cases("vt", _tokenizer("byte"), 512, 1)


def test_string_match_all_is_rulers():
    """RULER's metric: stripped, control characters as newlines, each reference found case-insensitively; the
    share of references found."""
    assert ruler.string_match_all(" 1234567.\n", ["1234567"]) == 1.0
    assert ruler.string_match_all("\nThe values are 11, 22 and 44.", ["11", "22", "33", "44"]) == 0.75
    assert ruler.string_match_all("APPLE pie", ["apple", "Pie", "plum"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("ab\x00cd", ["ab\ncd"]) == 1.0 and ruler.postprocess("\t x\x1fy \n") == "x\ny"
    assert ruler.string_match_all("", ["x"]) == 0.0

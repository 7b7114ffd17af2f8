"""`python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct (tests/smollm2.py),
trained for one step at learning rate 0 by `python -m jaxlong.train` on ring 8, as the documented command does,
then evaluated by the CLI (a child process, as a user runs it) on ring 2:
- RULER as RULER scores it (the default): a task of each family at 1K, one case each; every prompt's ids, every
  generated text and every score equal transformers' greedy generation scored by RULER's string_match_all
  (tests/fixtures/smollm2/ruler_generate.npz, made by tests/make_smollm2_generation.py);
- in the same run, passkey retrieval cell by cell, the validation loss and loss by position as the forward scored
  by hand (tests/smollm2_eval.py).
With JAXLONG_REAL_FORCED=1, also the teacher-forced proxy on one device: niah_single_1 at 1K case by case as the
hand-scored forward (the model answers 4 of 4), with passkey and loss again (about 130 CPU-s).
"""

import os

import numpy as np
import pytest
import smollm2
from smollm2_eval import ONE_DEVICE, PASSKEY, Hand, check_loss, check_passkey, check_ruler, evaluate, train_one_step

from jaxlong.data import HFTokenizer
from jaxlong.data.chat import ChatTemplate
from jaxlong.evaluation import ruler

pytestmark = pytest.mark.slow

RING2 = ("mesh.num_devices=2", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=1")
RULER_GOLDEN = smollm2.GOLDEN.with_name("ruler_generate.npz")  # tests/make_smollm2_generation.py ruler-generate
# One of each family: retrieval, tracing, aggregation (the golden file holds six tasks; cwe, the other aggregation
# task, generates RULER's 120 tokens where these stop by 50, and the batch decodes as long as its longest case)
RULER_TASKS = ("niah_multikey_3", "vt", "fwe")
RULER_LENGTH, RULER_CASES = 1024, 1


@pytest.fixture(scope="module")
def smol(optimized):  # the real model runs longer than it compiles (tests/xla_flags.py)
    return smollm2.build()


@pytest.fixture(scope="module")
def run_dir(smol, tmp_path_factory):
    return train_one_step(smol, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def hand(smol):
    return Hand(smol)


@pytest.mark.skipif(os.environ.get("JAXLONG_REAL_FORCED") != "1", reason="set JAXLONG_REAL_FORCED=1")
def test_cli_forced_scores_equal_the_hand_scored_forward(run_dir, hand):
    """The teacher-forced proxy on one device (a `mesh.num_devices=1` override): niah_single_1 at 1K, 4 of 4,
    case by case as the forward answers; passkey and loss by position too."""
    summary, cases = evaluate(run_dir, "--batches", "1", *PASSKEY, "--ruler", "--ruler-scoring", "forced",
                              "--ruler-tasks", "niah_single_1", "--ruler-lengths", "1024", "--ruler-cases", "4",
                              *ONE_DEVICE)
    assert summary["setup"]["mesh"] == {"data": 1, "fsdp": 1, "ring": 1, "context": 1}
    assert summary["ruler"]["scoring"] == "forced"
    assert [(r["task"], r["length"], r["correct"]) for r in summary["ruler"]["rows"]] == [("niah_single_1", 1024, 4)]
    check_ruler(hand, cases, ["niah_single_1"], [1024], 4)
    check_passkey(hand, summary)
    assert summary["passkey"]["mean"] > 0.5  # a pretrained model retrieves a passkey at 1K
    check_loss(hand, run_dir, summary)
    assert summary["loss"] < 3.5  # the pretrained model on held-out Python source (chance: ln 49152 = 10.8)


def test_cli_ruler_by_generation_equals_transformers_case_by_case(run_dir, smol, hand):
    """RULER as RULER scores it, through the CLI on ring 2 (a cache split by sequence, without the CPU time of 8
    simulated devices; ring 8's split cache is checked on the tiny model), 3 cases in one batch: each prompt's ids
    equal the golden file's (and, rendered as a chat, transformers' `apply_chat_template` with the
    answer prefix); each generated text equals transformers' greedy generation (RULER's tokens_to_generate, EOS
    from the generation config), or parts from it where transformers' top-2 logits are within 2e-3 (a near-tie);
    each case's score is RULER's string_match_all of that text. The same run's passkey grid, validation loss and
    loss by position equal the hand-scored forward's (the model retrieves the passkey at 1K)."""
    golden = dict(np.load(RULER_GOLDEN))
    rows_per_batch = len(RULER_TASKS) * RULER_CASES
    summary, rows = evaluate(run_dir, "--batches", "1", *PASSKEY, "--ruler", "--ruler-tasks",
                             ",".join(RULER_TASKS), "--ruler-lengths", str(RULER_LENGTH), "--ruler-cases",
                             str(RULER_CASES), f"global_batch={rows_per_batch}", *RING2)
    check_passkey(hand, summary)
    assert summary["passkey"]["mean"] > 0.5  # a pretrained model retrieves a passkey at 1K
    check_loss(hand, run_dir, summary, global_batch=rows_per_batch)
    assert summary["loss"] < 3.5  # the pretrained model on held-out Python source (chance: ln 49152 = 10.8)
    assert summary["ruler"]["scoring"] == "generate" and summary["setup"]["mesh"]["ring"] == 2
    tok, chat = HFTokenizer(smol), ChatTemplate(smol)
    made = {f"{c.task}/{c.index}": c for t in RULER_TASKS
            for c in ruler.generation_cases(t, tok, RULER_LENGTH, RULER_CASES, seed=0)}
    assert [f"{r['task']}/{r['index']}" for r in rows] == list(made)
    parted = {}
    for r in rows:
        key, case = f"{r['task']}/{r['index']}", made[f"{r['task']}/{r['index']}"]
        assert np.array_equal(case.prompt, golden[f"{key}/prompt"]) and int(r["prompt_tokens"]) == case.prompt.size
        chat_ids = ruler.render_prompt(case.text, case.answer_prefix, tok, chat)
        assert np.array_equal(chat_ids, golden[f"{key}/chat_prompt"]), key
        want = str(golden[f"{key}/text"])
        if r["generated"] != want:  # where they part, transformers' choice was a near-tie
            tokens = golden[f"{key}/tokens"]
            k = next(k for k in range(len(tokens)) if not r["generated"].startswith(tok.decode(tokens[:k + 1])))
            top2 = golden[f"{key}/top2"][k]
            assert top2[0] - top2[1] <= 2e-3, (key, k, top2, r["generated"], want)
            parted[key] = k
        assert float(r["score"]) == pytest.approx(ruler.string_match_all(r["generated"], case.refs), abs=1e-4)
    assert len(parted) <= 1, parted  # a tie is rare
    by_task = {t: np.mean([ruler.string_match_all(str(golden[f"{t}/{i}/text"]), made[f"{t}/{i}"].refs)
                           for i in range(RULER_CASES)]) for t in RULER_TASKS}
    if not parted:  # the summary's scores are transformers' text scored by RULER's metric
        assert {r["task"]: r["score"] for r in summary["ruler"]["rows"]} == pytest.approx(by_task)
    assert summary["ruler"]["mean"] > 0.3  # the model answers the needle, part of vt and fwe (0.51 in the golden)

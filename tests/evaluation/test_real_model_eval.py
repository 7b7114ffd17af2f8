"""`python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct (tests/smollm2.py),
trained for one step at learning rate 0 by `python -m jaxlong.train` on ring 8, as the documented command does,
then evaluated by the CLI (each a child process, as a user runs it). Every result equals the forward scored by hand
(tests/smollm2_eval.py):
- on ring 8 and on one device (a `mesh.num_devices=1` override): RULER niah_single_1 at 1K case by case (the model
  answers 6 of 6), passkey retrieval cell by cell, the validation loss and loss by position;
- on ring 2: one case of each RULER task family (retrieval, variable tracking, common and frequent words) at 1K
  (but `cwe`, which needs 1,812 tokens with this tokenizer), 2K and 4K tokens: the answers the hand-scored forward
  stored for these cases (`RULER_ANSWERS`, checked to be today's cases token by token), and one case scored by
  hand here again, so that the file is checked against the forward it came from.
"""

import pytest
import smollm2
from smollm2_eval import ONE_DEVICE, PASSKEY, RING8, RULER_SETS, Hand, check_loss, check_passkey, check_ruler, \
    evaluate, hand_ruler_answers, stored_ruler_answers, train_one_step

pytestmark = pytest.mark.slow

RING2 = ("mesh.num_devices=2", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=1")


@pytest.fixture(scope="module")
def smol(optimized):  # the real model runs longer than it compiles (tests/xla_flags.py)
    return smollm2.build()


@pytest.fixture(scope="module")
def run_dir(smol, tmp_path_factory):
    return train_one_step(smol, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def hand(smol):
    return Hand(smol)


@pytest.mark.parametrize("mesh", [RING8, ONE_DEVICE], ids=["ring8", "one_device"])
def test_cli_scores_equal_the_hand_scored_forward(run_dir, hand, mesh):
    """niah_single_1 at 1K: 6 of 6, case by case as the forward answers; passkey and loss by position too."""
    summary, cases = evaluate(run_dir, "--batches", "1", *PASSKEY, "--ruler", "--ruler-tasks", "niah_single_1",
                              "--ruler-lengths", "1024", "--ruler-cases", "6", *mesh)
    assert summary["setup"]["mesh"] == dict(zip(("data", "fsdp", "ring", "context"), (1, 1, 8, 1) if mesh == RING8
                                                else (1, 1, 1, 1)))
    assert [(r["task"], r["length"], r["correct"]) for r in summary["ruler"]["rows"]] == [("niah_single_1", 1024, 6)]
    check_ruler(hand, cases, ["niah_single_1"], [1024], 6)
    check_passkey(hand, summary)
    assert summary["passkey"]["mean"] > 0.5  # a pretrained model retrieves a passkey at 1K
    check_loss(hand, run_dir, summary)
    assert summary["loss"] < 3.5  # the pretrained model on held-out Python source (chance: ln 49152 = 10.8)


def test_every_task_family_at_1k_to_4k_equals_the_hand_scored_forward(run_dir, hand):
    (short_tasks, short), (tasks, lengths) = RULER_SETS
    # niah at 1K: the test above
    _, cases = evaluate(run_dir, "--batches", "1", "--no-passkey", "--ruler", "--ruler-tasks", ",".join(short_tasks),
                        "--ruler-lengths", ",".join(map(str, short)), "--ruler-cases", "1", *RING2)
    check_ruler(hand, cases, short_tasks, short, 1, stored_ruler_answers(hand, short_tasks, short, 1))
    summary, cases = evaluate(run_dir, "--batches", "1", "--no-passkey", "--ruler", "--ruler-tasks", ",".join(tasks),
                              "--ruler-lengths", ",".join(map(str, lengths)), "--ruler-cases", "1", *RING2)
    stored = stored_ruler_answers(hand, tasks, lengths, 1)
    check_ruler(hand, cases, tasks, lengths, 1, stored)
    assert summary["ruler"]["mean"] > 0  # the model answers some of them
    live = hand_ruler_answers(hand, ["vt"], [2048], 1)  # the stored answers are the forward's
    assert live == {k: stored[k] for k in live}

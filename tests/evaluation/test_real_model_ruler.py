"""RULER through `python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct
(tests/smollm2.py), one case of each task family (retrieval, variable tracking, common and frequent words) at 1K
(but `cwe`, which needs 1,812 tokens with this tokenizer; niah at 1K: tests/evaluation/test_real_model_eval.py),
2K and 4K tokens on a ring mesh, each answer equal to the forward scored by hand (tests/smollm2_eval.py): the
answers it stored for these cases (`RULER_ANSWERS`, checked to be today's cases token by token), and one case
scored by hand here again, so that the file is checked against the forward it came from.
"""

import pytest
import smollm2
from smollm2_eval import RULER_SETS, Hand, check_ruler, evaluate, hand_ruler_answers, stored_ruler_answers, \
    train_one_step

pytestmark = pytest.mark.slow

RING2 = ("mesh.num_devices=2", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=1")


def test_every_task_family_at_1k_to_4k_equals_the_hand_scored_forward(tmp_path, optimized):
    smol = smollm2.build()
    run_dir = train_one_step(smol, tmp_path)
    hand = Hand(smol)
    (short_tasks, short), (tasks, lengths) = RULER_SETS
    # niah at 1K: tests/evaluation/test_real_model_eval.py
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

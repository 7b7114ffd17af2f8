"""RULER through `python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct
(tests/smollm2.py), one case of each task family (retrieval, variable tracking, common and frequent words) at 1K
(but `cwe`, which needs 1,812 tokens with this tokenizer; niah at 1K: tests/evaluation/test_real_model_eval.py),
2K and 4K tokens on a ring mesh, each answer equal to the forward scored by hand (tests/smollm2_eval.py).
"""

import pytest
import smollm2
from smollm2_eval import FAMILIES, Hand, check_ruler, evaluate, train_one_step

pytestmark = pytest.mark.slow

RING2 = ("mesh.num_devices=2", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=1")


def test_every_task_family_at_1k_to_4k_equals_the_hand_scored_forward(tmp_path):
    smol = smollm2.build()
    run_dir = train_one_step(smol, tmp_path)
    hand = Hand(smol)
    _, cases = evaluate(run_dir, "--batches", "1", "--no-passkey", "--ruler", "--ruler-tasks", "vt,fwe",
                        "--ruler-lengths", "1024", "--ruler-cases", "1", *RING2)  # niah at 1K: test_real_model_eval
    check_ruler(hand, cases, ["vt", "fwe"], [1024], 1)
    summary, cases = evaluate(run_dir, "--batches", "1", "--no-passkey", "--ruler", "--ruler-tasks",
                              ",".join(FAMILIES), "--ruler-lengths", "2048,4096", "--ruler-cases", "1", *RING2)
    check_ruler(hand, cases, FAMILIES, [2048, 4096], 1)
    assert summary["ruler"]["mean"] > 0  # the model answers some of them

"""RULER through `python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct
(tests/smollm2.py), one case of each task family (retrieval, variable tracking, common and frequent words) at 2K
and 4K tokens on a ring mesh, each answer equal to the forward scored by hand (tests/smollm2_eval.py). At 1K:
tests/evaluation/test_real_model_eval.py (`cwe` needs 1,812 tokens with this tokenizer).
"""

import pytest
import smollm2
from smollm2_eval import FAMILIES, Hand, check_ruler, evaluate, train_one_step

pytestmark = pytest.mark.slow

RING2 = ("mesh.num_devices=2", "mesh.fsdp=1", "mesh.ring=2", "mesh.context=1")


def test_every_task_family_at_2k_and_4k_equals_the_hand_scored_forward(tmp_path):
    smol = smollm2.build()
    run_dir = train_one_step(smol, tmp_path)
    summary, cases = evaluate(run_dir, "--batches", "1", "--no-passkey", "--ruler", "--ruler-tasks",
                              ",".join(FAMILIES), "--ruler-lengths", "2048,4096", "--ruler-cases", "1", *RING2)
    check_ruler(Hand(smol), cases, FAMILIES, [2048, 4096], 1)
    assert summary["ruler"]["mean"] > 0  # the model answers some of them

"""`python -m jaxlong.eval` on a real pretrained model (slow tier): SmolLM2-135M-Instruct (tests/smollm2.py),
trained for one step at learning rate 0 by the trainer on ring 8, as the documented command does, then evaluated
by the CLI on ring 8 and on one device (a `mesh.num_devices=1` override). Every result equals the forward scored by
hand (tests/smollm2_eval.py): RULER niah_single_1 at 1K case by case (the model answers 6 of 6), passkey retrieval
cell by cell, the validation loss and loss by position.
"""

import pytest
import smollm2
from smollm2_eval import ONE_DEVICE, PASSKEY, RING8, Hand, check_loss, check_passkey, check_ruler, evaluate, \
    train_one_step

pytestmark = pytest.mark.slow


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

"""Evaluation: held-out validation (`heldout`), the eval and per-token steps and `evaluate_params` (`steps`), loss
by position and passkey retrieval (`probes`). The public names of the three modules are importable from here."""

from jaxlong.evaluation.heldout import eval_batch_size, held_out_documents, validation_batches, validation_split
from jaxlong.evaluation.probes import (
    FILLER,
    NEEDLE,
    QUESTION,
    PasskeyExample,
    PositionLoss,
    passkey_batch,
    passkey_example,
    passkey_min_length,
    position_buckets,
    random_key,
    score_passkey,
)
from jaxlong.evaluation.steps import (
    Evaluation,
    PasskeyGrid,
    Validator,
    compile_eval_step,
    evaluate_loss,
    evaluate_params,
    evaluate_preference,
    make_eval_step,
    make_preference_eval_step,
    make_token_stats_step,
    sequences_to_evaluate,
    tiled_token_stats,
    token_stats,
)

__all__ = [
    "eval_batch_size", "held_out_documents", "validation_batches", "validation_split", "FILLER", "NEEDLE",
    "QUESTION", "PasskeyExample", "PositionLoss", "passkey_batch", "passkey_example", "passkey_min_length",
    "position_buckets",
    "random_key", "score_passkey", "Evaluation", "PasskeyGrid", "Validator", "compile_eval_step", "evaluate_loss",
    "evaluate_params", "evaluate_preference", "make_preference_eval_step", "make_eval_step", "make_token_stats_step",
    "sequences_to_evaluate", "tiled_token_stats",
    "token_stats",
]

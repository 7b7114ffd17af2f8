"""Evaluation: the eval and per-token steps and `evaluate_params` (`steps`), loss by position and passkey retrieval
(`probes`), RULER (`ruler`), validation during training as hooks (`validation`) and the evaluation of a checkpoint
that `python -m jaxlong.eval` and a recipe's gates run (`checkpoint`). The public names of `probes` and `steps` are
importable from here."""

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
    compile_eval_step,
    evaluate_loss,
    evaluate_params,
    make_eval_step,
    make_token_stats_step,
    param_shardings,
    sequences_to_evaluate,
    tiled_token_stats,
    token_stats,
)

__all__ = [
    "FILLER", "NEEDLE", "QUESTION", "PasskeyExample", "PositionLoss", "passkey_batch", "passkey_example",
    "passkey_min_length", "position_buckets", "random_key", "score_passkey", "Evaluation", "PasskeyGrid",
    "compile_eval_step", "evaluate_loss", "evaluate_params", "make_eval_step", "make_token_stats_step",
    "param_shardings", "sequences_to_evaluate", "tiled_token_stats", "token_stats",
]

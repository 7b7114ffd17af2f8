"""RULER (Hsieh et al., arXiv 2404.06654): synthetic long-context tasks generated offline with the run's
tokenizer (`tasks`, `words`), scored teacher-forced on the training mesh (`score`), written as CSV, PNG, a table
and TensorBoard scalars (`report`). docs/evaluation.md#ruler describes the tasks and the scoring."""

from jaxlong.evaluation.ruler.report import (
    case_rows,
    format_table,
    log_scalars,
    write_cases,
    write_csv,
    write_heatmap,
    write_results,
)
from jaxlong.evaluation.ruler.score import (
    RulerSuite,
    RulerValidator,
    answers_on_mesh,
    check_length,
    check_lengths,
    generation_bytes,
    nearby_lengths,
    evaluate_ruler,
    generate,
    is_right,
    predict_answers,
    results,
    score_cases,
    score_on_mesh,
    suite_corpus,
    validation_suite,
)
from jaxlong.evaluation.ruler.tasks import TASKS, RulerCase, Task, case_depths, corpus_tokens, make_cases

__all__ = [
    "case_rows", "format_table", "log_scalars", "write_cases", "write_csv", "write_heatmap", "write_results",
    "RulerSuite", "RulerValidator", "answers_on_mesh", "check_length", "check_lengths", "evaluate_ruler",
    "generation_bytes", "nearby_lengths", "generate", "is_right",
    "predict_answers", "results", "score_cases", "score_on_mesh", "suite_corpus", "validation_suite", "TASKS",
    "RulerCase", "Task", "case_depths", "corpus_tokens", "make_cases",
]

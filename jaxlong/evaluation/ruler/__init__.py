"""RULER (Hsieh et al., arXiv 2404.06654): synthetic long-context tasks generated offline with the run's
tokenizer (`tasks`, `words`), scored teacher-forced on the training mesh (`score`), written as CSV, PNG, a table
and TensorBoard scalars (`report`). docs/evaluation.md#ruler describes the tasks and the scoring."""

from jaxlong.evaluation.ruler.report import format_table, log_scalars, write_csv, write_heatmap, write_results
from jaxlong.evaluation.ruler.score import (
    RulerSuite,
    RulerValidator,
    check_length,
    evaluate_ruler,
    generate,
    results,
    score_cases,
    score_on_mesh,
    suite_corpus,
    validation_suite,
)
from jaxlong.evaluation.ruler.tasks import TASKS, RulerCase, Task, case_depths, corpus_tokens, make_cases

__all__ = [
    "format_table", "log_scalars", "write_csv", "write_heatmap", "write_results", "RulerSuite", "RulerValidator",
    "check_length", "evaluate_ruler", "generate", "results", "score_cases", "score_on_mesh", "suite_corpus", "validation_suite", "TASKS", "RulerCase",
    "Task", "case_depths", "corpus_tokens", "make_cases",
]

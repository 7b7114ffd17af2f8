"""RULER (Hsieh et al., arXiv 2404.06654): synthetic long-context tasks generated offline with the run's
tokenizer (`tasks`, `words`), put in RULER's prompts (`prompts`) and scored by greedy generation on the training
mesh with RULER's string_match_all (`generated`), or teacher-forced as a cheap proxy (`score`), written as CSV,
PNG, a table and TensorBoard scalars (`report`). docs/evaluation.md#ruler describes the tasks and the scoring."""

from jaxlong.evaluation.ruler.report import (
    CASE_COLUMNS,
    case_rows,
    format_table,
    log_scalars,
    tag_prefix,
    write_heatmap,
    write_results,
)
from jaxlong.evaluation.ruler.score import (
    RulerGeneration,
    RulerSuite,
    RulerValidator,
    answers_on_mesh,
    check_length,
    check_lengths,
    generation_bytes,
    nearby_lengths,
    evaluate_ruler,
    is_right,
    results,
    score_cases,
    score_on_mesh,
    suite_corpus,
    validation_suite,
)
from jaxlong.evaluation.ruler.generated import (
    generation_case_rows,
    outputs_on_mesh,
    rows_per_batch,
    score_outputs,
)
from jaxlong.evaluation.ruler.prompts import (
    SCORINGS,
    TEMPLATES,
    TOKENS_TO_GENERATE,
    generation_cases,
    postprocess,
    render_prompt,
    string_match_all,
)
from jaxlong.evaluation.ruler.tasks import TASKS, RulerCase, Task, TooShort, corpus_tokens, make_cases

__all__ = [
    "CASE_COLUMNS", "case_rows", "format_table", "log_scalars", "tag_prefix", "generation_case_rows", "outputs_on_mesh",
    "rows_per_batch", "score_outputs", "SCORINGS", "TEMPLATES", "TOKENS_TO_GENERATE", "generation_cases", "postprocess",
    "render_prompt", "string_match_all", "TooShort", "write_heatmap", "write_results", "RulerGeneration", "RulerSuite",
    "RulerValidator", "answers_on_mesh", "check_length", "check_lengths", "evaluate_ruler", "generation_bytes",
    "nearby_lengths", "is_right", "results", "score_cases", "score_on_mesh", "suite_corpus", "validation_suite",
    "TASKS", "RulerCase", "Task", "corpus_tokens", "make_cases",
]

"""Validation during training, as a hook of the trainer (`jaxlong.training.hooks`; what it logs: `validation_hooks`).

The trainer holds the documents out and makes their batches (`RunContext.validation_batches`); the hook compiles
the objective's eval step when the run starts (its memory printed before step 1) and generates RULER's cases then,
before the train step compiles, and scores the step's parameters when due. `python -m jaxlong.train` adds these
hooks (`jaxlong.recipes.train`); a user's own run adds them with `run(cfg, hooks=validation_hooks(cfg))`.
"""

from __future__ import annotations

from jaxlong.config import Config
from jaxlong.core.memstats import format_compiled
from jaxlong.data import tokenizer_source
from jaxlong.data.tokenizer import stop_ids
from jaxlong.evaluation import ruler
from jaxlong.evaluation.steps import compile_eval_step, evaluate_loss
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training.hooks import Hook, RunContext, StepContext

__all__ = ["validation_hooks"]


def validation_hooks(cfg: Config) -> list[Hook]:
    """The validation hook of a run: every `eval_every` steps (and after the last) the held-out loss (`eval/loss`,
    `eval/perplexity`; an objective's own under its key, e.g. `eval/dpo/loss` and `eval/dpo/rewards/...`), then
    with `ruler_tasks` RULER's scores. None with `eval_every=0`.

    Raises (from its start, before anything compiles): ConfigError for a RULER length the mesh does not take or a
    task too long for it.
    """
    if not cfg.eval_every:
        return []
    parts: dict = {}

    def start(run: RunContext) -> None:
        # an objective without held-out data of its own (GRPO's rollouts): the held-out documents' text loss
        parts["objective"] = run.objective if run.objective.held_out_loss else LanguageModeling()
        suite = ruler.validation_suite(run.cfg)
        if suite:  # lengths checked, then cases generated now, before anything compiles
            ruler.check_lengths(run.cfg, suite.lengths, "ruler_lengths", cases=suite.cases, tasks=len(suite.tasks))
            corpus = ruler.suite_corpus(suite, (run.source[i] for i in run.held_out), run.tokenizer)
            eos = stop_ids(run.tokenizer, tokenizer_source(run.cfg, run.run_dir))
            parts["ruler"] = ruler.RulerValidator(run.cfg, run.mesh, run.tokenizer, suite, corpus,
                                                  option="ruler_lengths", eos_ids=eos)
        parts["step"] = compile_eval_step(run.cfg, run.mesh, parts["objective"])
        run.say(format_compiled(parts["step"], "eval step"))

    def validate(ctx: StepContext) -> None:
        objective = parts["objective"]
        ev = evaluate_loss(parts["step"], ctx.params, ctx.run.validation_batches, ctx.run.mesh, objective)
        if ctx.writer is not None:
            prefix = f"eval/{objective.summary_key}/" if objective.summary_key else "eval/"
            for k, v in ev.items():
                if k != objective.unit:  # the count of held-out tokens or pairs
                    ctx.writer.add_scalar(prefix + k, v, ctx.step)
        ctx.say(f"step {ctx.step}: eval loss {objective.describe(ev)}")
        suite = parts.get("ruler")
        if suite is not None:
            rows = suite.run(ctx.params)
            if ctx.writer is not None:
                ruler.log_scalars(ctx.writer, rows, ctx.step, ruler.tag_prefix(suite.scoring))
            ctx.say(f"step {ctx.step}: ruler ({suite.scoring}) " + ", ".join(
                f"{r['task']}@{r['length']} {r['correct']:.3g}/{r['cases']}" for r in rows))

    return [Hook(validate, every=cfg.eval_every, name="validation", start=start)]

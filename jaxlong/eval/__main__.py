"""Evaluate a training run: `python -m jaxlong.eval RUN_DIR [--step N] [options] [key=value ...]`.

Restores the latest (or `--step N`) checkpoint of `RUN_DIR` (e.g. `runs/default`) on the mesh of the config it
was trained with (`key=value` overrides change it, e.g. `mesh.context=8`), then measures:

* validation loss and perplexity on the held-out documents (the split the trainer used: `eval_fraction`, `seed`),
  with the AOT-compiled eval step (its memory_analysis is printed);
* loss by position: mean per-token loss of the same held-out sequences in log-spaced position buckets
  (0, 1, 2-3, 4-7, ..., up to seq_len), as a table, a CSV and a PNG;
* passkey retrieval, teacher-forced, on a needle depth x context length grid (`--depths`, `--lengths`), drawn as a
  heatmap;
* with `--ruler`, RULER's synthetic tasks (`jaxlong.evaluation.ruler`; `--ruler-tasks`, `--ruler-lengths`,
  `--ruler-cases`), scored as RULER scores them (`--ruler-scoring generate`, the default: RULER's prompts, greedy
  generation of RULER's tokens_to_generate on the run's mesh, string_match_all; `--chat` renders each prompt as a
  user turn of the checkpoint's chat template) or teacher-forced by exact match (`--ruler-scoring forced`, a
  cheap proxy): a table, `ruler.csv`, `ruler_cases.csv` (what the model wrote), `ruler_prompts.jsonl` (what it
  was asked), `ruler.png` (score by task and length) and `eval/ruler_<scoring>/...` scalars. Corpus haystacks are
  cut from the held-out documents; RULER and passkey need no validation batches (`--batches 0`).

Each evaluation setup has its own directory, `RUN_DIR/eval/<setup>/`, named by the mesh it ran on
(`mesh_<data>x<fsdp>x<ring>x<context>`) and, when other config keys or flags differ from the run's config and the
flags' defaults, a short hash of them (`mesh_1x2x1x4-3f9a0c1e`): results go to `<setup>/step_N/` (`summary.json`,
which records the setup, `loss_by_position.{csv,png}`, `passkey.{csv,png}`) and to TensorBoard events in
`<setup>/` (`eval/loss`, `eval/perplexity`, `eval/passkey_accuracy`, `eval/loss_by_position/<start>`,
`eval/ruler_<scoring>/<task>/<length>`; one
TensorBoard run per setup, beside the trainer's). Evaluations of other setups never overwrite each other; the
same evaluation run again replaces its own results and events. Launched as several processes, as the trainer is
(`srun`, or `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`; `jaxlong.core.distributed`), it
evaluates on one mesh over all of them and process 0 prints and writes the results. The evaluation itself is the
library's (`jaxlong.evaluation.checkpoint`), which a recipe's gates run too. Examples:

    python -m jaxlong.eval runs/default
    python -m jaxlong.eval runs/default --step 20 --lengths 512,1024,2048,4096 --depths 0,0.5,1 --per-cell 8
    python -m jaxlong.eval runs/default --ruler --ruler-tasks niah_single_1,vt --ruler-lengths 1024,4096
"""

from __future__ import annotations

import argparse
import sys

from jaxlong.core import distributed, liveness
from jaxlong.core.errors import ArgumentParser, fail
from jaxlong.evaluation.checkpoint import EvalOptions, evaluate, resolve

__all__ = ["parse_args", "options", "main"]


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m jaxlong.eval", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory holding checkpoints/ (e.g. runs/default)")
    d = EvalOptions()  # the defaults: the library's options
    p.add_argument("--step", type=int, default=d.step, help="checkpoint step (default: the latest)")
    p.add_argument("--batches", type=int, default=d.batches, help="held-out batches (default: the run's "
                                                                  "eval_batches; 0: no validation loss)")
    p.add_argument("--lengths", default=d.lengths, help="passkey context lengths, comma-separated (default: those of "
                                                        "S/8,S/4,S/2,S that hold the passkey prompt and the mesh takes)")
    p.add_argument("--depths", default=d.depths, help="passkey needle depths in [0, 1]")
    p.add_argument("--per-cell", type=int, default=d.per_cell, help="passkey examples per depth x length cell")
    p.add_argument("--digits", type=int, default=d.digits, help="passkey digits")
    p.add_argument("--no-passkey", dest="passkey", action="store_false")
    p.add_argument("--ruler", action="store_true", help="run RULER's synthetic tasks (docs/evaluation.md#ruler)")
    p.add_argument("--ruler-tasks", default=d.ruler_tasks, help="RULER tasks, comma-separated (default: all 11: "
                                                     "niah_single_1,...,vt,cwe,fwe)")
    p.add_argument("--ruler-lengths", default=d.ruler_lengths, help="RULER context lengths, comma-separated (default: those of "
                                                       "S/8,S/4,S/2,S the mesh takes; pairs too short for a task "
                                                       "are skipped)")
    p.add_argument("--ruler-cases", type=int, default=d.ruler_cases, help="RULER cases per task and length")
    p.add_argument("--ruler-scoring", choices=("generate", "forced"), default=d.ruler_scoring,
                   help="generate (default, RULER's own): greedy generation of each task's tokens_to_generate, "
                        "scored by string_match_all; forced: teacher-forced exact match, a cheap proxy")
    p.add_argument("--chat", action="store_true", help="RULER by generation: each prompt as a user turn of the "
                                                       "checkpoint's chat template, the answer prefix opening the "
                                                       "assistant's turn")
    p.add_argument("overrides", nargs="*", help="config key=value overrides (e.g. mesh.context=8)")
    return p.parse_intermixed_args(argv)


def options(args: argparse.Namespace) -> EvalOptions:
    """The parsed flags as the library's `EvalOptions`."""
    return EvalOptions(**{k: v for k, v in vars(args).items() if k != "run_dir"})


def main(argv=None) -> int:
    args = parse_args(argv)
    opts = options(args)
    try:
        run_dir, step, cfg = resolve(args.run_dir, opts)
    except (FileNotFoundError, ValueError) as e:  # ConfigError is a ValueError
        return fail(e)
    try:  # several processes (srun, or JAX_COORDINATOR_ADDRESS ...): one mesh over them
        distributed.start(cfg.mesh, cfg.lost_process_timeout_s)
        evaluate(cfg, run_dir, step, opts)
    except (FileNotFoundError, ValueError) as e:  # a bad override, a corpus that cannot be read
        return fail(e)
    except Exception:  # a collective that failed because another process died: its one line
        liveness.explain_failure()
        raise
    finally:
        liveness.stop_watchdog()
    return 0


if __name__ == "__main__":
    sys.exit(main())

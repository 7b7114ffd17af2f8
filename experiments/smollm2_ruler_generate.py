"""RULER by generation of SmolLM2-135M-Instruct through `python -m jaxlong.eval`, beside the teacher-forced proxy of
the same checkpoint and transformers' own greedy generation on the same prompts.

The run and its evaluations (CPU; every command in experiments/results/smollm2_ruler_generate.md): the
checkpoint of experiments/smollm2_ruler.py (one step at learning rate 0 on a ring of 8), evaluated by
`python -m jaxlong.eval RUN --ruler --ruler-scoring generate` and `--ruler-scoring forced` at the same lengths.
Three steps, the second in an environment with torch, transformers and gguf (not jaxlong's dependencies):

    python experiments/smollm2_ruler_generate.py prompts RUN/eval/<setup>/step_1 /tmp/prompts.json
    /tmp/tfenv/bin/python experiments/smollm2_ruler_generate.py transformers /tmp/prompts.json /tmp/hf.json
    python experiments/smollm2_ruler_generate.py table RUN --hf /tmp/hf.json --out experiments/results

`prompts` remakes the cases of one evaluation by generation exactly as the CLI made them (its `summary.json`
names the flags and overrides; `jaxlong.evaluation.checkpoint.ruler_suite` on the same held-out split), checks them
against the evaluation's `ruler_cases.csv` (the same cases, the same prompt lengths) and writes each case's prompt
ids, tokens_to_generate and reference items. `transformers` generates each prompt greedily with transformers'
GGUF import of the same model (float32, `max_new_tokens` = RULER's tokens_to_generate, `do_sample=False`, EOS
from the generation config; tests/make_smollm2_generation.py `ruler_generate`; an evaluation with YaRN gives its
`model.rope_scaling` overrides to transformers as `rope_parameters`) and decodes with
`skip_special_tokens=True`. `table` scores that text with jaxlong's `string_match_all`, gathers every RULER
evaluation of step 1 under `RUN/eval/` (generation, teacher-forced; a length with YaRN is a column of its own) and
the transformers file into
`smollm2_ruler_generate.csv` (scoring, task, length, rope, cases, score), `smollm2_ruler_generate_cases.csv`
(every generated case: jaxlong's text and score, transformers' text and score, whether the texts are equal) and
`smollm2_ruler_generate.png` (three grids), and prints the tables.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from ruler_generate_report import SCORINGS, YARN_KEYS, collect, column_label, columns, heatmap, hf_key, rope_scaling, \
    table, write_csv, yarn_factor


def _argv(step_dir: Path, summary: dict) -> list[str]:
    """The `python -m jaxlong.eval` arguments that made the evaluation in `step_dir` (from its summary.json)."""
    flags, argv = summary["setup"]["flags"], [str(step_dir.parents[2])]
    for key, value in flags.items():
        if key == "passkey":
            argv += [] if value else ["--no-passkey"]
        elif key in ("ruler", "chat"):
            argv += [f"--{key}"] if value else []
        else:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + list(summary["setup"]["overrides"])


def prompts(step_dir: Path, out: Path) -> None:
    """The cases of the evaluation by generation in `step_dir`, made again as the CLI made them, to `out`."""
    from jaxlong import data as data_lib
    from jaxlong.data.heldout import validation_split
    from jaxlong.evaluation.checkpoint import EvalOptions, resolve, ruler_suite

    summary = json.loads((step_dir / "summary.json").read_text())
    argv = _argv(step_dir, summary)
    args = EvalOptions(**summary["setup"]["flags"], overrides=list(summary["setup"]["overrides"]))
    assert args.ruler_scoring == "generate", f"{step_dir}: not an evaluation by generation"
    run_dir, _, cfg = resolve(step_dir.parents[2], args)
    tokenizer = data_lib.run_tokenizer(cfg, run_dir)
    source = data_lib.first_source(cfg)
    held_out, _ = validation_split(cfg, source, tokenizer, args.batches)
    cases, _ = ruler_suite(cfg, args, tokenizer, source, held_out)
    with open(step_dir / "ruler_cases.csv") as f:
        cli = {(r["task"], int(r["length"]), int(r["index"])): r for r in csv.DictReader(f)}
    assert len(cli) == len(cases), f"{len(cases)} cases made again, {len(cli)} in the CLI's ruler_cases.csv"
    data = {}
    for c in cases:
        row = cli[(c.task, c.length, c.index)]
        assert int(row["prompt_tokens"]) == c.prompt.size, (c.task, c.length, c.index, row["prompt_tokens"])
        assert row["answer"] == ", ".join(c.refs), (c.task, c.length, c.index)
        data[f"{c.task}/{c.length}/{c.index}"] = {
            "task": c.task, "length": c.length, "index": c.index, "prompt": [int(i) for i in c.prompt],
            "ttg": c.tokens_to_generate, "refs": list(c.refs), "jaxlong": row["generated"],
            "jaxlong_score": float(row["score"]), "stopped": row["stopped"], "yarn": yarn_factor(argv) is not None}
    out.write_text(json.dumps({"eval": str(step_dir), "argv": argv, "cases": data}))
    print(f"wrote {out}: {len(data)} cases of {step_dir} (python -m jaxlong.eval {' '.join(argv)}), each equal to "
          f"the CLI's in count, prompt length and answer")


def transformers_generate(path: Path, out: Path, lengths: list[int] | None) -> None:
    """transformers' greedy generation of each case of `path` (a `prompts` file), as RULER runs it."""
    import time

    import tokenizers
    import torch
    import transformers

    data = json.loads(path.read_text())
    cache = Path.home() / ".cache" / "jaxlong" / "test-models"
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(cache, gguf_file=name)
    models: dict = {}

    def model_for(yarn: bool):
        """The GGUF model in float32; with YaRN, the evaluation's `model.rope_scaling` overrides as transformers'
        `rope_parameters` (max_position_embeddings = factor x original, as transformers derives the factor)."""
        if yarn not in models:
            config = transformers.AutoConfig.from_pretrained(cache, gguf_file=name)
            if yarn:
                rs = rope_scaling(data["argv"])
                assert set(rs) <= YARN_KEYS, f"{sorted(set(rs) - YARN_KEYS)}: not passed on to transformers"
                theta = (config.rope_parameters or {}).get("rope_theta", getattr(config, "rope_theta", None))
                config.rope_parameters = {"rope_type": "yarn", "rope_theta": theta, "factor": float(rs["factor"]),
                                          "original_max_position_embeddings":
                                              int(rs["original_max_position_embeddings"])}
                config.max_position_embeddings = int(float(rs["factor"]) * int(rs["original_max_position_embeddings"]))
            models[yarn] = transformers.AutoModelForCausalLM.from_pretrained(
                cache, gguf_file=name, config=config, dtype=torch.float32).eval()
        return models[yarn]

    done = json.loads(out.read_text())["cases"] if out.exists() else {}
    t0 = time.perf_counter()
    for key, case in data["cases"].items():
        yarn = bool(case.get("yarn"))  # prompts files made before YaRN was handled hold no YaRN cases
        key = hf_key(key, yarn_factor(data["argv"]) if yarn else None)
        if key in done or (lengths and case["length"] not in lengths):
            continue
        model = model_for(yarn)
        x = torch.tensor([case["prompt"]], dtype=torch.long)
        with torch.no_grad():
            seq = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=case["ttg"],
                                 pad_token_id=tok.pad_token_id or 2)
        new = seq[0, x.shape[1]:].tolist()
        text = tok.decode(new, skip_special_tokens=True)
        eos = model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        done[key] = {"refs": case["refs"], "tokens": new, "text": text, "yarn": yarn,
                     "stopped": "eos" if new and new[-1] in eos else "length"}  # EOS ends `new`, not `text`
        print(f"{time.perf_counter() - t0:7.1f}s {key} {len(case['prompt'])}+{len(new)} {text[:70]!r}", flush=True)
        out.write_text(json.dumps({"made_with": (
            f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"tokenizers {tokenizers.__version__}; {name} dequantized to float32, greedy (do_sample=False), "
            f"max_new_tokens = RULER's tokens_to_generate, EOS from the generation config ({sorted(eos)})"),
            "cases": done}))
    print(f"wrote {out}: {len(done)} cases")


def keep_earlier(directory: Path, rows: list[dict], cases: list[dict]) -> tuple[list[dict], list[dict]]:
    """`rows` and `cases` with the earlier CSVs' cells (scoring, task, length, rope) and cases (task, length, rope)
    that they do not hold again, read back with their types."""
    def read(name):
        with open(directory / name, newline="") as f:
            return list(csv.DictReader(f))

    cells = {(r["scoring"], r["task"], int(r["length"]), r["rope"]) for r in rows}
    old_rows = [{**r, "length": int(r["length"]), "cases": int(r["cases"]), "score": float(r["score"])}
                for r in read("smollm2_ruler_generate.csv")]
    kept = [r for r in old_rows if (r["scoring"], r["task"], r["length"], r["rope"]) not in cells]
    groups = {(c["task"], str(c["length"]), c["rope"]) for c in cases}
    old_cases = [{**c, "same_text": "" if c["same_text"] == "" else int(c["same_text"])}
                 for c in read("smollm2_ruler_generate_cases.csv")]
    return kept + rows, [c for c in old_cases if (c["task"], c["length"], c["rope"]) not in groups] + cases


def combined(rows: list[dict]) -> str:
    """One table, a task per line and a length per column, each cell `generation / teacher-forced / transformers`
    in percent (`-`: not run); then each scoring's mean over the tasks run at that length (RULER's per-length
    average), and over the tasks run at every length of several tasks in both of jaxlong's scorings."""
    labelled = columns(rows)
    tasks = list(dict.fromkeys(r["task"] for r in labelled if r["scoring"] == "generate"))
    tasks += [t for t in dict.fromkeys(r["task"] for r in labelled) if t not in tasks]
    lengths = sorted({r["length"] for r in labelled})
    score = {(r["scoring"], r["task"], r["length"]): r["score"] for r in labelled}

    def cell(values, digits=0) -> str:
        return "/".join("-" if v is None else f"{100 * v:.{digits}f}" for v in values)

    def mean(scoring, names, n, every=False):
        got = [score[(scoring, t, n)] for t in names if (scoring, t, n) in score]
        return sum(got) / len(got) if got and (len(got) == len(names) or not every) else None

    # the lengths where several tasks ran in both scorings (not a one-task column), and the tasks run at all of them
    # both by generation and teacher-forced: a like-for-like mean across those lengths and the two scorings
    several = [n for n in lengths if sum(("generate", t, n) in score and ("forced", t, n) in score
                                         for t in tasks) > 1]
    everywhere = [t for t in tasks if all((s, t, n) in score for n in several for s in ("generate", "forced"))]
    common = f"mean, {len(everywhere)} tasks of {column_label(several[0])}-{column_label(several[-1])}"
    width = max(len(t) for t in tasks + [common])
    body = [(t, [cell(score.get((s, t, n)) for s in SCORINGS) if any((s, t, n) in score for s in SCORINGS)
                 else "" for n in lengths]) for t in tasks]
    body += [(label, [cell((mean(s, names, n, every) if n in at else None for s in SCORINGS), 1) for n in lengths])
             for label, names, every, at in (("mean, the tasks run", tasks, False, lengths),
                                             (common, everywhere, True, several))]
    col = max(len(c) for _, cells in body for c in cells)
    col = max(col, *(len(column_label(n)) for n in lengths))
    lines = [f"{'gen/forced/hf, %':<{width}}  " + "  ".join(f"{column_label(n):>{col}}" for n in lengths)]
    lines += [(f"{label:<{width}}  " + "  ".join(f"{c:>{col}}" for c in cells)).rstrip() for label, cells in body]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("prompts")
    a.add_argument("step_dir", type=Path)
    a.add_argument("out", type=Path)
    b = sub.add_parser("transformers")
    b.add_argument("prompts", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("--lengths", default="", help="only these lengths, comma-separated (default: all)")
    c = sub.add_parser("table")
    c.add_argument("run_dir", type=Path)
    c.add_argument("--hf", type=Path, default=None, help="the `transformers` output")
    c.add_argument("--out", type=Path, default=Path("experiments/results"))
    c.add_argument("--keep", type=Path, default=None,
                   help="a directory of this script's earlier CSVs: their cells and cases that RUN_DIR does not "
                        "score again are kept (evaluations run on another machine)")
    args = p.parse_args()
    if args.cmd == "prompts":
        return prompts(args.step_dir, args.out)
    if args.cmd == "transformers":
        return transformers_generate(args.prompts, args.out, [int(x) for x in args.lengths.split(",") if x])
    rows, cases = collect(args.run_dir, args.hf)
    if args.keep:
        rows, cases = keep_earlier(args.keep, rows, cases)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in (("smollm2_ruler_generate.csv", rows), ("smollm2_ruler_generate_cases.csv", cases)):
        write_csv(args.out / name, data)
    heatmap(args.out / "smollm2_ruler_generate.png", rows, "SmolLM2-135M-Instruct, RULER (CPU)")
    for scoring in SCORINGS:
        if any(r["scoring"] == scoring for r in rows):
            print(f"\n{scoring}, %:\n{table(rows, scoring)}")
    print(f"\n{combined(rows)}")
    compared = [c for c in cases if c["same_text"] != ""]
    same = sum(c["same_text"] for c in compared)
    print(f"\njaxlong's and transformers' generated text identical in {same} of {len(compared)} cases")
    for c in compared:
        if not c["same_text"]:
            print(f"  differs: {c['task']}/{c['length']}/{c['index']}: jaxlong {c['jaxlong'][:60]!r} | "
                  f"transformers {c['transformers'][:60]!r}")


if __name__ == "__main__":
    main()

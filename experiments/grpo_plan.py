"""GRPO of Llama-3.1-8B on 8 x H100 with 128K and 1M-token prompts, G = 8 completions of 1K tokens: tokens computed
per group with and without the shared prefix, GiB per device of the train step (XLA's GPU compile, no GPU) and
estimated rollout and training time per step.

    python experiments/grpo_plan.py --out experiments/results

For each prompt length P, one group per step (`grpo.prompts_per_step=1`, `global_batch=1`):

* shared prefix (jaxlong): one row of P - 1 + G (R + 1) tokens (`jaxlong.data.groups`), compiled as GRPO's train
  step (`objective=grpo`, `grpo.beta=0.04`: the KL reference's FSDP-sharded copy counted beside the step);
* separate rows (what TRL and verl train on): G rows of P + R tokens, as G micro-batches of one row
  (`grad_accum=G`): memory of one row (compiled, the language-modelling step: the same forward and backward), time
  G x that row's step.

The memory setup is the post-training recipe's (`configs/recipes/llama3_1_8b_post_training.yaml`: Ulysses over the 8
GPUs, every layer's input offloaded to the host, tiled loss and MLP, bf16 compute, float32 weights and AdamW).
Training time: the planner's roofline of the compiled step (`jaxlong.plan.cost`, 60% of the dense bf16 peak).
Rollout time and memory: from `experiments/results/generation_scale_llama3.1-8b_h100.md` (GPU compile and
estimate of the same model's prefill and decode step): the prompt prefilled once, then R decode steps whose G rows
read the one prompt cache together (`Sampling.n`), each step costing what one row's costs there (the G rows add G
query rows to a step that is bound by reading the weights and the cache). Nothing here is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from experiments.provenance import commit, machine  # noqa: E402
from jaxlong.config import ConfigError, load_config, validate  # noqa: E402
from jaxlong.plan import planner  # noqa: E402
from jaxlong.plan.target import parse_target  # noqa: E402

GIB = 2**30
G, R = 8, 1024
SETUP = ["mesh.num_devices=8", "mesh.data=1", "mesh.fsdp=1", "mesh.context=8", "attention.impl=ulysses",
         "attention.block_q=512", "attention.block_k=512", "remat.policy=offload", "remat.offload_every=1",
         "remat.keep_attention=0", "tiling.loss=true", "tiling.mlp=true", "compute_dtype=bfloat16",
         "param_dtype=float32", "global_batch=1", "data.packing=documents", "model.rope_scaling.type=yarn",
         "model.rope_scaling.factor=128", "model.rope_scaling.original_max_position_embeddings=8192"]
GRPO = ["objective=grpo", f"grpo.num_generations={G}", f"grpo.max_completion_length={R}", "grpo.beta=0.04",
        "grpo.prompts_per_step=1"]
# the `--fit` search of the 1M group (its JSON summarised on the page)
FIT_ARGS = ("--config configs/llama3_1_8b.yaml objective=grpo grpo.num_generations=8 grpo.max_completion_length=1024 "
            "grpo.beta=0.04 grpo.prompts_per_step=1 grpo.ruler_lengths=[1048576] global_batch=1 seq_len=1057280 "
            "data.packing=documents model.rope_scaling.type=yarn model.rope_scaling.factor=128 "
            "model.rope_scaling.original_max_position_embeddings=8192")
# experiments/results/generation_scale_llama3.1-8b_h100.md (GPU compile and estimate): prefill seconds, decode ms
# per token with the weights sharded / replicated, prefill and decode totals in GiB per device (bf16 weights)
GENERATION = {131072: dict(prefill_s=1.4, sharded_ms=37.3, replicated_ms=6.0, prefill_gib=7.6, decode_gib=7.3),
              1048576: dict(prefill_s=64.1, sharded_ms=41.8, replicated_ms=11.0, prefill_gib=29.5, decode_gib=21.3)}


def length(cfg_overrides: list[str], least: int) -> int:
    """The least seq_len >= `least` this setup takes (the mesh's and kernels' divisibility rules)."""
    for n in range(least, least + 65536):
        try:
            validate(load_config("configs/llama3_1_8b.yaml", [*cfg_overrides, f"seq_len={n}"]))
            return n
        except ConfigError:
            continue
    raise ValueError(least)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="h100")
    ap.add_argument("--lengths", default="131072,1048576")
    ap.add_argument("--out", default="experiments/results")
    ap.add_argument("--cache", default="runs/grpo_plan_cache.json")
    ap.add_argument("--fit-json", default="experiments/results/fit_grpo_llama3.1-8b_1048576_h100.json",
                    help="a `python -m jaxlong.memory --fit --out` search of the 1M group, summarised on the page")
    args = ap.parse_args()
    target = parse_target(args.target)
    os.makedirs(os.path.dirname(args.cache), exist_ok=True)
    cache = json.load(open(args.cache)) if os.path.exists(args.cache) else {}
    rows = []
    for p_len in [int(x) for x in args.lengths.split(",")]:
        shared_ov = [*SETUP, *GRPO, f"grpo.ruler_lengths=[{p_len}]"]
        shared_len = length(shared_ov, p_len - 1 + G * (R + 1))
        separate_len = length(SETUP, p_len + R)
        for name, ov, seq in (("shared", shared_ov, shared_len), ("separate", SETUP, separate_len)):
            key = f"{name}|{p_len}|{args.target}"
            if key not in cache:
                t0 = time.time()
                plan = planner.plan(load_config("configs/llama3_1_8b.yaml", [*ov, f"seq_len={seq}"]), target,
                                    estimate=True)
                cache[key] = {"seq_len": seq, "seconds": time.time() - t0, "step_s": plan["estimate"]["step_seconds"],
                              **{k: plan[k] for k in ("params", "optimizer", "activations", "peak", "reference",
                                                      "total", "host_per_node")}}
                json.dump(cache, open(args.cache, "w"), indent=1)
                print(f"{name} at P={p_len:,}: seq_len {seq:,}, total {cache[key]['total'] / GIB:.1f} GiB, step "
                      f"{cache[key]['step_s']:.1f} s (compiled in {cache[key]['seconds']:.0f} s)", flush=True)
        s, d, gen = cache[f"shared|{p_len}|{args.target}"], cache[f"separate|{p_len}|{args.target}"], GENERATION[p_len]
        resident = (s["params"] + s["optimizer"] + s["reference"]) / GIB  # the train state stays during rollouts
        rows.append({"prompt": p_len, "shared_tokens": p_len - 1 + G * (R + 1), "separate_tokens": G * (p_len + R),
                     "shared": s, "separate": d,
                     "rollout_sharded_s": gen["prefill_s"] + R * gen["sharded_ms"] / 1e3,
                     "rollout_replicated_s": gen["prefill_s"] + R * gen["replicated_ms"] / 1e3,
                     "rollout_gib": resident + gen["prefill_gib"], "budget_gib": target.device_memory / GIB})
    write(args, rows, target)


def _fit_section(path: str) -> list[str]:
    """The page's lines on the `--fit` search of a GRPO train step (`path`, its JSON), if there is one."""
    if not os.path.exists(path):
        return []
    d = json.load(open(path))
    w = d["winner"]
    return [
        "## `--fit` on the 1M group", "",
        f"`python -m jaxlong.memory --fit --target h100 --max-compiles 8 --out {path} {FIT_ARGS}` "
        f"([{os.path.basename(path)}]({os.path.basename(path)})) searched {d['candidates']} setups of the GRPO "
        f"train step at seq_len {d['seq_len']:,} with {d['compiles']} GPU compiles. Its winner, "
        f"`{' '.join(o for o in w['overrides'].split() if not o.endswith('=0') or 'keep' in o)}`, takes "
        f"{w['total'] / GIB:.1f} GiB per device (the reference's 3.7 included) and {w['host_per_node'] / GIB:.0f} "
        f"GiB of host memory per node, an estimated {w['step_seconds']:.0f} s per step ({w['tokens_per_s_per_gpu']:.0f} "
        "tokens/s per GPU): faster than the offload setup above, which leaves more room for the rollout. "
        "The rollout's prefill is not part of the train step and is not in `--fit`'s total (the table above adds "
        "it): with this winner the two do not hold their peaks at once, since the step's activations are freed "
        "before the next rollout.",
    ]


def write(args, rows: list[dict], target) -> None:
    lines = [
        "# GRPO of Llama-3.1-8B on 8 x H100: 128K and 1M-token prompts, G = 8, 1K-token completions (GPU compile "
        "and estimate)", "",
        "**No GPU was used.** Memory is XLA's GPU compile of the train step for 8 compile-only H100 80 GB "
        "(`jaxlong.plan.target`); times are the planner's roofline estimate (`jaxlong/plan/cost.py`) and, for "
        "rollouts, the estimates of [generation_scale_llama3.1-8b_h100.md](generation_scale_llama3.1-8b_h100.md). "
        "Nothing here is measured.", "",
        f"Command: `python experiments/grpo_plan.py --out {args.out}` ({machine()}, jaxlong {commit()}).", "",
        "Setup: one group per step (1 prompt, G = 8 completions of up to R = 1,024 tokens), "
        "`grpo.beta=0.04` (the KL reference kept as a second FSDP-sharded float32 copy on the GPUs, in the "
        "`reference` column), the post-training recipe's memory setup: " + f"`{' '.join(SETUP)}`.", "",
        "## Tokens computed per group", "",
        "| prompt P | shared prefix: P - 1 + G (R + 1) | separate rows: G (P + R) | saving |", "|---:|---:|---:|---:|",
        *(f"| {r['prompt']:,} | {r['shared_tokens']:,} | {r['separate_tokens']:,} | "
          f"{r['separate_tokens'] / r['shared_tokens']:.2f}x |" for r in rows), "",
        "## Train step per device (GPU compile) and estimated time", "",
        "| prompt P | layout | seq_len | params + AdamW | reference | activations | **total** GiB | host / node GiB "
        "| est. train s / group |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for name, n in (("shared prefix, 1 row", 1), (f"separate, {G} rows of P + R", G)):
            p = r["shared" if n == 1 else "separate"]
            lines.append(f"| {r['prompt']:,} | {name} | {p['seq_len']:,} | {(p['params'] + p['optimizer']) / GIB:.1f} "
                         f"| {p['reference'] / GIB:.1f} | {p['activations'] / GIB:.1f} | **{p['total'] / GIB:.1f}** | "
                         f"{p['host_per_node'] / GIB:.0f} | {n * p['step_s']:.1f} |")
    lines += [
        "", "The separate layout's memory is one of its rows (a micro-batch), compiled as the language-modelling "
        "step (the same forward and backward, without GRPO's per-token entries and reference); its time is G "
        "micro-batches.", "",
        "## Rollout per group (estimate) and the step", "",
        "| prompt P | prefill once + 1,024 decode steps, weights sharded / replicated (s) | GiB per device during "
        "the rollout (train state + prefill) | est. step (rollout + train), shared (s) | same, separate rows for "
        "training (s) |", "|---:|---:|---:|---:|---:|",
        *(f"| {r['prompt']:,} | {r['rollout_sharded_s']:.1f} / {r['rollout_replicated_s']:.1f} | "
          f"{r['rollout_gib']:.1f} of {r['budget_gib']:.1f} | "
          f"{r['rollout_replicated_s'] + r['shared']['step_s']:.0f} | "
          f"{r['rollout_replicated_s'] + G * r['separate']['step_s']:.0f} |" for r in rows), "",
        "During the rollout the train state stays on the GPUs (float32 weights, AdamW's moments and the "
        "reference) beside the generation's prefill (its bf16 weights, activations and prompt cache, from the "
        "generation page). A prompt cache per completion instead of one per group would hold G = 8 copies: 128 GiB "
        "per GPU at 1M, which does not fit.", "",
        *_fit_section(args.fit_json), "",
        "## Beside the reach others report", "",
        "| framework | long-prompt GRPO | source |", "|---|---|---|",
        "| TRL | no context parallelism for GRPO: a prompt and its completion must fit one GPU's activations | "
        "TRL PR #5699 |",
        "| verl | Ulysses in training, separate vLLM rollouts; the Ulysses degree is capped by the KV heads, OOM "
        "reported at 16K-token responses; prefix sharing listed as incompatible with Ulysses and ring | verl "
        "issues #1226, #453 |",
        "| QwenLong-L1 (on verl) | prompts grown from 20K to 60K to 120K tokens | arXiv 2505.17667 |",
        "| LoongRL | trains at 16K, solves 128K | arXiv 2510.19363 |",
        "| Unsloth (PrefixGrouper) | the prompt once per group on one GPU: 2.55x faster, 3.37x less memory in "
        "its benchmark | unsloth PR #6871 |",
        f"| jaxlong (this page, estimate) | 1M-token prompts, G = {G}, one group per step on one node of 8 "
        "H100: the prompt computed once in the rollout and in training | above |",
    ]
    out = []
    for line in lines:  # paragraphs wrapped; tables, headings and code as they are
        plain = line and not line.startswith(("|", "#", "!", "`"))
        out.append(textwrap.fill(line, width=118, break_on_hyphens=False) if plain else line)
    path = os.path.join(args.out, "grpo_plan_llama3.1-8b_h100.md")
    open(path, "w").write("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()

"""Positions a preference pair takes in a row with its prompt once (`data.shared_prompt=true`) against the chosen
and rejected halves each with the prompt (`false`), on the shipped pairs.

    python experiments/shared_prompt_tokens.py --out experiments/results [--logps]

Reads `configs/data/stdlib_preference.jsonl` (189 pairs) as the tiny DPO recipe renders it (byte tokenizer,
`configs/chat_templates/chatml.jinja`) and, where the SmolLM2 checkpoint directory exists (`tests/smollm2.py`
builds it), with SmolLM2's tokenizer and chat template, as `experiments/smollm2_dpo.py` does. Counts positions
(next-token pairs) per pair and the rows of `--seq-len` that the pipeline's first-fit packing fills with every
pair once. With `--logps` it also runs the DPO reference pass of SmolLM2 over every pair in both layouts on one CPU
device and reports how far the summed log-probs differ (the same loss on real weights). Writes
`shared_prompt_tokens.md` under `--out`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
PAIRS = ROOT / "configs" / "data" / "stdlib_preference.jsonl"
SMOLLM2 = Path.home() / ".cache" / "jaxlong" / "test-models" / "smollm2-135m-instruct"


def _rows(lengths: np.ndarray, seq_len: int) -> int:
    """Rows first-fit packing needs for these element lengths (file order, unlimited bins: a lower bound on
    the pipeline's 16 bins)."""
    free: list[int] = []
    for n in lengths:
        for i, f in enumerate(free):
            if f >= n:
                free[i] -= n
                break
        else:
            free.append(seq_len - n)
    return len(free)


def measure(tokenizer, template, seq_len: int) -> dict:
    from jaxlong.data.preference import PreferenceSource  # noqa: PLC0415

    src = {shared: PreferenceSource(PAIRS, tokenizer, template, seq_len, shared_prompt=shared) for shared in (False, True)}
    prompts = np.array([src[True][i].prompt_length for i in range(len(src[True]))])
    return {"pairs": len(prompts), "prompt": float(prompts.mean()), "separate": int(src[False].lengths.sum()),
            "shared": int(src[True].lengths.sum()), "rows_separate": _rows(src[False].lengths, seq_len),
            "rows_shared": _rows(src[True].lengths, seq_len)}


def reference_logps(seq_len: int) -> float:
    """The largest difference (nats) between SmolLM2-135M-Instruct's summed response log-probs of every pair, chosen
    and rejected, with the prompt once and with each half apart: the DPO reference pass
    (`jaxlong.objectives.reference.compute_reference`) on one CPU device, float32, both layouts."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no CUDA initialization on a host without a GPU
    import jax  # noqa: PLC0415

    from jaxlong.config import load_config, runtime  # noqa: PLC0415
    from jaxlong.core.mesh import build_mesh  # noqa: PLC0415
    from jaxlong.data import first_source, run_tokenizer  # noqa: PLC0415
    from jaxlong.models import hf, llama  # noqa: PLC0415
    from jaxlong.objectives.base import Preparation  # noqa: PLC0415
    from jaxlong.objectives.reference import compute_reference  # noqa: PLC0415

    out = {}
    for shared in (False, True):
        cfg = load_config(None, [f"model.from_hf={SMOLLM2}", f"data.path={PAIRS}", "data.format=preference",
                                 "objective=dpo", f"seq_len={seq_len}", "global_batch=4", "mesh.num_devices=1",
                                 "mesh.fsdp=1", "mesh.context=1", "attention.block_q=128", "attention.block_k=128",
                                 f"data.shared_prompt={str(shared).lower()}"])
        mesh = build_mesh(cfg.mesh, jax.devices()[:1])
        tok = run_tokenizer(cfg)
        source = first_source(cfg, tok)
        params = hf.load_params(SMOLLM2, cfg.model, mesh, cfg.param_dtype)
        run = Preparation(cfg, ROOT, source, tok, llama.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh),
                          None, None)
        out[shared] = compute_reference(run, params)
    return float(np.abs(out[True] - out[False]).max()), float(np.abs(out[False]).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--logps", action="store_true", help="also SmolLM2's reference log-probs both ways (CPU, minutes)")
    args = ap.parse_args()
    from jaxlong.data.chat import run_template  # noqa: PLC0415
    from jaxlong.data.tokenizer import ByteTokenizer, get_tokenizer  # noqa: PLC0415

    cases = [("byte tokenizer, chatml.jinja (configs/recipes/tiny_dpo.yaml)", ByteTokenizer(),
              run_template(str(ROOT / "configs" / "chat_templates" / "chatml.jinja"), None, mark_generation=True))]
    if (SMOLLM2 / "tokenizer.json").is_file():
        cases.append(("SmolLM2-135M-Instruct's tokenizer and chat template (experiments/smollm2_dpo.py)",
                      get_tokenizer(str(SMOLLM2 / "tokenizer.json")),
                      run_template(None, SMOLLM2, mark_generation=True)))
    lines = ["# A preference pair's prompt once: positions on the shipped pairs", "",
             f"`python experiments/shared_prompt_tokens.py --out experiments/results{' --logps' if args.logps else ''}` "
             f"(seq_len {args.seq_len}; {platform.machine()}, Python {sys.version.split()[0]}; the counts are host "
             f"tokenization, the log-probs a CPU run).", "",
             "Each pair of `configs/data/stdlib_preference.jsonl` packed as today (chosen and rejected, each with "
             "the prompt: `data.shared_prompt=false`) and with the prompt once (`true`, the two responses as "
             "branches after it). The loss, its gradients and the metrics are the same either way "
             "(`tests/training/test_dpo.py`, the `shared-*` meshes). Rows: first-fit packing of every pair once.", "",
             "| tokenizer and template | pairs | mean shared prompt (tokens) | positions, separate | positions, "
             "prompt once | saved | rows, separate | rows, prompt once |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, tok, template in cases:
        m = measure(tok, template, args.seq_len)
        saved = 1 - m["shared"] / m["separate"]
        lines.append(f"| {name} | {m['pairs']} | {m['prompt']:.1f} | {m['separate']:,} | {m['shared']:,} | "
                     f"{saved:.1%} | {m['rows_separate']} | {m['rows_shared']} |")
        print(lines[-1])
    if args.logps and (SMOLLM2 / "model.safetensors").is_file():
        diff, mean = reference_logps(args.seq_len)
        lines += ["", f"With `--logps`: SmolLM2-135M-Instruct's summed response log-probs of all 189 pairs (chosen and "
                  f"rejected), the DPO reference pass on one CPU device in float32, differ by at most {diff:.2e} nats "
                  f"between the two layouts (their mean magnitude: {mean:.1f} nats)."]
        print(lines[-1])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prompt_tokens.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

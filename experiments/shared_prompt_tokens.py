"""Positions a preference pair takes in a row with its prompt once (`data.shared_prompt=true`) against the chosen
and rejected halves each with the prompt (`false`), on the shipped pairs.

    python experiments/shared_prompt_tokens.py --out experiments/results

Reads `configs/data/stdlib_preference.jsonl` (189 pairs) as the tiny DPO recipe renders it (byte tokenizer,
`configs/chat_templates/chatml.jinja`) and, where the SmolLM2 checkpoint directory exists (`tests/smollm2.py`
builds it), with SmolLM2's tokenizer and chat template, as `experiments/smollm2_dpo.py` does. Counts positions
(next-token pairs) per pair and the rows of `--seq-len` that the pipeline's first-fit packing fills with every
pair once. Writes `shared_prompt_tokens.md` under `--out`. No device work: host tokenization only.
"""

from __future__ import annotations

import argparse
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

    out = {}
    for shared in (False, True):
        src = PreferenceSource(PAIRS, tokenizer, template, seq_len, shared_prompt=shared)
        out[shared] = (src.lengths, _rows(src.lengths, seq_len))
    prompts = np.array([PreferenceSource(PAIRS, tokenizer, template, seq_len, shared_prompt=True)[i].prompt_length
                        for i in range(len(out[True][0]))])
    return {"pairs": len(prompts), "prompt": float(prompts.mean()), "separate": int(out[False][0].sum()),
            "shared": int(out[True][0].sum()), "rows_separate": out[False][1], "rows_shared": out[True][1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "experiments" / "results")
    ap.add_argument("--seq-len", type=int, default=1024)
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
             f"`python experiments/shared_prompt_tokens.py --out experiments/results` (seq_len {args.seq_len}; "
             f"{platform.machine()}, Python {sys.version.split()[0]}; host tokenization only, no device).", "",
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "shared_prompt_tokens.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

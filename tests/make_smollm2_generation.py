"""Make `tests/fixtures/smollm2/generate.npz`: transformers' greedy continuations of SmolLM2-135M-Instruct, the
second path that `python -m jaxlong.generate` is checked against (tests/generation/test_real_model_generate.py).

Two steps, in two environments (transformers and torch are not test dependencies):

    python tests/make_smollm2_generation.py prompts /tmp/prompts.json          # jaxlong's environment
    python tests/make_smollm2_generation.py generate /tmp/prompts.json         # with torch, transformers, gguf

RULER by generation's golden file, `tests/fixtures/smollm2/ruler_generate.npz`, is made the same way with
`ruler-prompts` and `ruler-generate` in place of `prompts` and `generate`.

The first writes the prompts: real text (Python source and English prose from the standard library, a plain
question, a function to complete), RULER cases of 512 tokens (jaxlong's tasks, the prompt before the answer), as token ids, and chat
conversations as messages. The second loads the model with transformers' own GGUF loader (float32), renders the
conversations with transformers' `apply_chat_template` (the GGUF's template), generates 64 tokens greedily
(`do_sample=False`, no stop) for each prompt on its own, and stores the prompt ids, the generated ids, the
top-2 logits of each generated step and the versions that made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "fixtures" / "smollm2" / "generate.npz"
NEW_TOKENS = 64
CHATS = {
    "chat_capital": [{"role": "user", "content": "What is the capital of France?"}],
    "chat_haiku": [{"role": "system", "content": "You are a poet."},
                   {"role": "user", "content": "Write a haiku about the sea."}],
}


def prompts(path: str) -> None:
    import inspect  # noqa: PLC0415
    import argparse as argparse_module  # noqa: PLC0415
    import this  # noqa: F401, PLC0415 (prints the Zen once)
    import codecs  # noqa: PLC0415

    sys.path.insert(0, str(ROOT))
    import smollm2  # noqa: PLC0415

    from jaxlong.data import HFTokenizer  # noqa: PLC0415
    from jaxlong.evaluation import ruler  # noqa: PLC0415

    smol = smollm2.build()
    tok = HFTokenizer(smol)
    source = inspect.getsource(argparse_module.ArgumentParser.parse_known_args)
    zen = codecs.decode(sys.modules["this"].s, "rot13")
    texts = {"python_source": source[:700], "zen_prose": zen[:420], "question": "The capital of France is",
             "code_start": "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"}
    out = {"text": {k: [int(i) for i in tok.encode_prompt(v)] for k, v in texts.items()}, "chat": CHATS, "ruler": {}}
    filler = " ".join(zen.split()) + " "
    corpus = ruler.corpus_tokens([filler * 40], tok, 1 << 14)
    for task in ("niah_single_1", "niah_multivalue"):
        case = ruler.make_cases(task, tok, 512, 1, seed=0, corpus=corpus)[0]
        out["ruler"][task] = [int(i) for i in case.tokens[:int(case.answer[0]) + 1]]  # inputs before the answer
    Path(path).write_text(json.dumps(out))
    print(f"wrote {path}: {sum(len(v) for v in out['text'].values())} text tokens, {len(out['ruler'])} RULER cases")


def _transformers_model():
    """transformers' tokenizer and float32 model of SmolLM2-135M-Instruct, read from the GGUF file itself."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    cache = Path.home() / ".cache" / "jaxlong" / "test-models"
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = transformers.AutoTokenizer.from_pretrained(cache, gguf_file=name)
    return tok, transformers.AutoModelForCausalLM.from_pretrained(cache, gguf_file=name, dtype=torch.float32).eval()


def _versions() -> str:
    import gguf  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tokenizers  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    return (f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
            f"tokenizers {tokenizers.__version__}, gguf {getattr(gguf, '__version__', '?')}, numpy {np.__version__}")


def generate(path: str) -> None:
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    data = json.loads(Path(path).read_text())
    tok, model = _transformers_model()
    prompts = dict(data["text"])
    prompts.update({k: list(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
                    for k, m in data["chat"].items()})
    prompts.update(data["ruler"])
    arrays = {}
    for key, ids in prompts.items():
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=2)
        new = out.sequences[0, len(ids):].numpy()
        top2 = np.stack([torch.topk(s[0], 2).values.numpy() for s in out.scores])
        arrays[f"{key}/prompt"] = np.asarray(ids, np.int32)
        arrays[f"{key}/tokens"] = new.astype(np.int32)
        arrays[f"{key}/top2"] = top2.astype(np.float32)
        print(key, len(ids), repr(tok.decode(new)[:80]))
    arrays["chat_messages"] = np.array(json.dumps(data["chat"]))
    arrays["made_with"] = np.array(f"{_versions()}; greedy, do_sample=False, {NEW_TOKENS} new tokens, no EOS stop, "
                                   f"float32")
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT}")


RULER_OUT = OUT.with_name("ruler_generate.npz")
RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe", "fwe")  # no corpus haystack
RULER_LENGTH, RULER_CASES = 1024, 1


def ruler_prompts(path: str) -> None:
    """RULER by generation's cases at 1K (`jaxlong.evaluation.ruler.generation_cases`, seed 0, the run's default):
    each prompt's ids, RULER's tokens_to_generate and reference items; and one case's user text and answer prefix
    for the chat rendering."""
    sys.path.insert(0, str(ROOT))
    import smollm2  # noqa: PLC0415

    from jaxlong.data import HFTokenizer  # noqa: PLC0415
    from jaxlong.evaluation import ruler  # noqa: PLC0415

    tok = HFTokenizer(smollm2.build())
    out = {}
    for task in RULER_TASKS:
        for c in ruler.generation_cases(task, tok, RULER_LENGTH, RULER_CASES, seed=0):
            out[f"{task}/{c.index}"] = {"prompt": [int(i) for i in c.prompt], "ttg": c.tokens_to_generate,
                                        "refs": list(c.refs), "text": c.text, "prefix": c.answer_prefix}
    Path(path).write_text(json.dumps(out))
    print(f"wrote {path}: {len(out)} RULER cases")


def ruler_generate(path: str) -> None:
    """transformers' greedy generation of each RULER case, as RULER runs it: `tokens_to_generate` new tokens at
    most, stopping at the model's EOS (its generation config); and the chat rendering of each case's user text
    with the answer prefix after the assistant's opening."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    data = json.loads(Path(path).read_text())
    tok, model = _transformers_model()
    arrays = {}
    for key, case in data.items():
        ids = case["prompt"]
        x = torch.tensor([ids], dtype=torch.long)
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                 max_new_tokens=case["ttg"], output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id or 2)
        new = out.sequences[0, len(ids):].numpy()
        arrays[f"{key}/prompt"] = np.asarray(ids, np.int32)
        arrays[f"{key}/tokens"] = new.astype(np.int32)
        arrays[f"{key}/top2"] = np.stack([torch.topk(s[0], 2).values.numpy() for s in out.scores]).astype(np.float32)
        arrays[f"{key}/text"] = np.array(tok.decode(new, skip_special_tokens=True))
        chat = tok.apply_chat_template([{"role": "user", "content": case["text"]}], add_generation_prompt=True,
                                       tokenize=False) + case["prefix"]
        arrays[f"{key}/chat_prompt"] = np.asarray(tok(chat, add_special_tokens=False)["input_ids"], np.int32)
        print(key, len(ids), len(new), repr(tok.decode(new, skip_special_tokens=True)[:80]))
    arrays["made_with"] = np.array(f"{_versions()}; greedy, do_sample=False, RULER's tokens_to_generate, EOS from "
                                   f"the generation config, float32")
    np.savez_compressed(RULER_OUT, **arrays)
    print(f"wrote {RULER_OUT}")


if __name__ == "__main__":
    {"prompts": prompts, "generate": generate, "ruler-prompts": ruler_prompts,
     "ruler-generate": ruler_generate}[sys.argv[1]](sys.argv[2])

"""Make `tests/fixtures/smollm2/chat_sft.json`: transformers' token ids and assistant masks of chat conversations
under SmolLM2-135M-Instruct's chat template, the second path that jaxlong's chat data
(`jaxlong.data.chat_data`) is checked against (tests/data/test_chat_data.py).

Run with transformers installed (it is not a test dependency), after `python tests/smollm2.py` built the model
directory:

    python tests/make_smollm2_chat.py

For each conversation it stores `apply_chat_template(messages, tokenize=True)` under the checkpoint's template,
and the `assistant_masks` of `apply_chat_template(..., return_assistant_tokens_mask=True)` under the same
template with `{% generation %}` tags around each assistant turn's content and end of turn (`TAGGED`, stored
too), with the versions that made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "fixtures" / "smollm2" / "chat_sft.json"
CONVERSATIONS = [
    [{"role": "user", "content": "What is RoPE?"},
     {"role": "assistant", "content": "Rotary position embeddings rotate queries and keys by their position."}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "And of Italy?"},
     {"role": "assistant", "content": "Rome"}],
    [{"role": "user", "content": "Écris « bonjour » en japonais."},
     {"role": "assistant", "content": "こんにちは (konnichiwa) — 'hello'.\n\nIt's used during the day."}],
]
# SmolLM2's template with each assistant turn's content and end of turn inside {% generation %} (as TRL asks of a
# template for its assistant-only loss)
TAGGED = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def main() -> None:
    import transformers  # noqa: PLC0415
    from transformers import AutoTokenizer  # noqa: PLC0415

    sys.path.insert(0, str(ROOT))
    import smollm2  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(str(smollm2.build()))
    out = {"made_by": f"transformers {transformers.__version__}", "tagged_template": TAGGED, "cases": []}
    for messages in CONVERSATIONS:
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=True)
        tagged = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=True,
                                         chat_template=TAGGED, return_assistant_tokens_mask=True)
        assert list(tagged["input_ids"]) == list(ids["input_ids"])
        out["cases"].append({"messages": messages, "ids": [int(i) for i in ids["input_ids"]],
                             "assistant_masks": [int(m) for m in tagged["assistant_masks"]]})
    OUT.write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

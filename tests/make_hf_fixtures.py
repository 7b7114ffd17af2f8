"""Create the tiny Hugging Face checkpoints under tests/fixtures/hf/ and their golden `transformers` outputs.

Needs torch, transformers, safetensors, tokenizers, numpy and grain (jaxlong.data, which cuts the training batch,
imports it; the tests themselves need only safetensors, tokenizers and numpy), e.g. in a separate virtual
environment, run from the repository root:

    python -m venv /tmp/venv-hf && /tmp/venv-hf/bin/pip install torch transformers safetensors tokenizers numpy grain
    /tmp/venv-hf/bin/python tests/make_hf_fixtures.py

Writes, for `llama31` (Llama-3.1 layout: GQA, `llama3` rope scaling, untied head, bf16 weights) and `qwen3`
(q/k norms, explicit head_dim != hidden/heads, tied head, float32 weights):
  <name>/config.json, model.safetensors (llama31: two shards + model.safetensors.index.json),
  tokenizer.json + tokenizer_config.json (a tiny BPE trained on the sentences below),
  golden.npz: `prompt` int32 [1, 64], `logits` float32 [1, 64, vocab] (transformers, float32), and
  `batch_inputs`/`batch_targets` int32 [2, 64] with `batch_loss` (mean next-token cross-entropy, transformers):
  the first batch of `jaxlong.train` on corpus.txt with seq_len=64, global_batch=2, seed=0.
rope.npz with transformers' inverse frequencies and attention factor for the RoPE scalings in ROPE_CASES,
and RECORD.md with the command and package versions. All weights are random (std 0.1, norms 1 +- 0.1),
so every tensor, its layout and its position in the model matter.

Head counts cover the context-parallel cases of tests/models/test_hf.py: llama31 has 8 query / 2 KV heads (KV heads
replicated at context C = 4 and 8), qwen3 16 query / 4 KV heads (KV heads split at C = 4, replicated at C = 8;
its 16 query heads allow U-Pipe with U = C and U = 2C at both C = 4 and C = 8).
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import sys
from pathlib import Path

import numpy as np
import safetensors
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent / "fixtures" / "hf"
sys.path.insert(0, str(ROOT.parents[2]))  # the repository: jaxlong.data's batches (numpy and grain, no jax)

SENTENCES = [
    "Long context training splits the sequence over devices and the heads over stages.",
    "Rotary position embeddings rotate pairs of dimensions by an angle proportional to the position.",
    "The quick brown fox jumps over the lazy dog while the model learns to predict the next token.",
    "Attention heads are exchanged with an all-to-all so each device holds whole heads for the full sequence.",
    "Grouped query attention shares one key and value head among several query heads.",
]
PROMPT = "The model rotates the heads of the long sequence over devices and predicts the next token."
SEQ = 64
VOCAB = 128


def make_tokenizer(directory: Path) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:0], show_progress=False)
    tok.train_from_iterator(SENTENCES + [PROMPT], trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|end_of_text|>")
    fast.save_pretrained(directory)
    assert fast.vocab_size <= VOCAB, fast.vocab_size
    return fast


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def prompt_ids(tok) -> np.ndarray:
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    ids = (ids * (SEQ // len(ids) + 1))[:SEQ]
    return np.asarray([ids], np.int32)


def first_batch(directory: Path) -> dict:
    """A batch of corpus.txt (the test checks the model's loss on it against transformers'): its documents
    tokenized and concatenated, the first two windows of SEQ + 1 tokens (stride SEQ)."""
    from jaxlong.data import (  # noqa: PLC0415
        DocumentSource,
        HFTokenizer,  # noqa: PLC0415
        document_tokens,
    )

    tok, source = HFTokenizer(directory), DocumentSource(ROOT / "corpus.txt")
    tokens = np.concatenate([document_tokens(source[i], tok) for i in range(len(source))])
    w = np.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(2)]).astype(np.int32)
    return {"inputs": w[:, :-1], "targets": w[:, 1:]}


def build(name: str, config: transformers.PretrainedConfig, cls, dtype: torch.dtype, shard: bool) -> None:
    out = ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    torch.manual_seed(0)
    model = cls(config).eval()
    randomize(model, seed=len(name))
    # The saved (possibly bf16) weights are the model: compute the golden outputs from them in float32.
    model = model.to(dtype).to(torch.float32)
    model.save_pretrained(out, max_shard_size="100KB" if shard else "100MB")
    if dtype != torch.float32:  # rewrite the weights in dtype
        model.to(dtype).save_pretrained(out, max_shard_size="100KB" if shard else "100MB")
        model = model.to(torch.float32)
    reloaded = cls.from_pretrained(out, dtype=torch.float32).eval()
    prompt = prompt_ids(tok)
    batch = first_batch(out)
    with torch.no_grad():
        logits = reloaded(input_ids=torch.from_numpy(prompt).long()).logits.float().numpy()
        blog = reloaded(input_ids=torch.from_numpy(batch["inputs"]).long()).logits.float()
        loss = torch.nn.functional.cross_entropy(blog.reshape(-1, blog.shape[-1]),
                                                 torch.from_numpy(batch["targets"]).long().reshape(-1))
    np.savez(out / "golden.npz", prompt=prompt, logits=logits.astype(np.float32), batch_inputs=batch["inputs"],
             batch_targets=batch["targets"], batch_loss=np.float32(loss.item()))
    print(f"{name}: {sum(p.numel() for p in reloaded.parameters())} parameters, loss {loss.item():.6f}")


# RoPE scalings whose inverse frequencies and attention factor transformers computes for rope.npz.
ROPE_CASES = [
    {"head_dim": 64, "theta": 500000.0, "max_pos": 131072,
     "params": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}},
    {"head_dim": 128, "theta": 1000000.0, "max_pos": 131072,
     "params": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
    {"head_dim": 64, "theta": 10000.0, "max_pos": 16384,
     "params": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False,
                "original_max_position_embeddings": 2048}},
    {"head_dim": 64, "theta": 10000.0, "max_pos": 16384,
     "params": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25, "original_max_position_embeddings": 2048}},
    {"head_dim": 32, "theta": 10000.0, "max_pos": 8192, "params": {"rope_type": "linear", "factor": 4.0}},
    {"head_dim": 128, "theta": 1000000.0, "max_pos": 40960, "params": {"rope_type": "default"}},
]


def rope_reference() -> None:
    """rope.npz: for each of ROPE_CASES, transformers' inverse frequencies and attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415

    arrays = {}
    for i, case in enumerate(ROPE_CASES):
        params = dict(case["params"], rope_theta=case["theta"])
        config = transformers.LlamaConfig(hidden_size=case["head_dim"] * 4, num_attention_heads=4,
                                          head_dim=case["head_dim"], max_position_embeddings=case["max_pos"],
                                          rope_parameters=params)
        kind = params["rope_type"]
        if kind == "default":
            inv = 1.0 / (case["theta"] ** (torch.arange(0, case["head_dim"], 2, dtype=torch.float) / case["head_dim"]))
            factor = 1.0
        else:
            inv, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        arrays[f"inv_freq_{i}"] = inv.float().numpy()
        arrays[f"attention_factor_{i}"] = np.float64(factor)
    np.savez(ROOT / "rope.npz", cases=json.dumps(ROPE_CASES), **arrays)


def gemma3_text_config(**extra) -> transformers.Gemma3TextConfig:
    """Tiny Gemma 3: 4 layers local-global-local-global with a window of 8, 4 query heads and 1 KV head of 16,
    `query_pre_attn_scalar` 24 (not head_dim), linear x8 RoPE on the global layers (base 1M; 10K on local ones)."""
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=24, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}, **extra)


def build_gemma3() -> None:
    """`gemma3_text/` (`Gemma3ForCausalLM`) and `gemma3/` (the multimodal `Gemma3ForConditionalGeneration` with a
    tiny SigLIP tower; its language model has the text model's weights), each with transformers' float32 logits
    of the prompt (`golden.npz`: `prompt`, `logits`)."""
    for name in ("gemma3_text", "gemma3"):
        out = ROOT / name
        out.mkdir(parents=True, exist_ok=True)
        tok = make_tokenizer(out)
        torch.manual_seed(0)
        if name == "gemma3_text":
            model = transformers.Gemma3ForCausalLM(gemma3_text_config()).eval()
            randomize(model, seed=7)
            text_state = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, image_size=16, patch_size=8)
            config = transformers.Gemma3Config(text_config=gemma3_text_config().to_dict(),
                                               vision_config=vision.to_dict(), mm_tokens_per_image=4)
            model = transformers.Gemma3ForConditionalGeneration(config).eval()
            randomize(model, seed=8)
            lm = model.model.language_model
            lm.load_state_dict({k[len("model."):]: v for k, v in text_state.items() if k.startswith("model.")})
        model.save_pretrained(out)
        reloaded = type(model).from_pretrained(out, dtype=torch.float32).eval()
        prompt = prompt_ids(tok)
        with torch.no_grad():
            logits = reloaded(input_ids=torch.from_numpy(prompt).long()).logits.float().numpy()
        np.savez(out / "golden.npz", prompt=prompt, logits=logits.astype(np.float32))
        print(f"{name}: {sum(p.numel() for p in reloaded.parameters())} parameters")


def main() -> None:
    if sys.argv[1:] == ["gemma3"]:  # the Gemma 3 fixtures alone
        build_gemma3()
        return
    ROOT.mkdir(parents=True, exist_ok=True)
    rope_reference()
    (ROOT / "corpus.txt").write_text(" ".join(SENTENCES * 4) + "\n")
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=500000.0, bos_token_id=None, eos_token_id=1, pad_token_id=None,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256},
    )
    build("llama31", llama, transformers.LlamaForCausalLM, torch.bfloat16, shard=True)
    qwen = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=16,
        num_key_value_heads=4, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=None, eos_token_id=1, pad_token_id=None,
    )
    build("qwen3", qwen, transformers.Qwen3ForCausalLM, torch.float32, shard=False)
    build_gemma3()
    versions = (f"python {platform.python_version()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}, safetensors {safetensors.__version__}, tokenizers "
                f"{tokenizers.__version__}, numpy {np.__version__}, grain {importlib.metadata.version('grain')}")
    (ROOT / "RECORD.md").write_text(
        "# Hugging Face fixtures\n\nTiny random Llama-3.1 (`llama31/`: GQA 8/2 heads, `llama3` rope scaling, "
        "bf16 weights in two shards) and Qwen3 (`qwen3/`: q/k norms, GQA 16/4 heads of head_dim 16 with hidden 32, "
        "tied head, float32) checkpoints with `transformers`' float32 logits on a fixed prompt and its loss on "
        "jaxlong's first training batch from `corpus.txt` (`golden.npz`).\n\n"
        f"Made by `python tests/make_hf_fixtures.py` with {versions}.\n")
    print(versions)


if __name__ == "__main__":
    main()

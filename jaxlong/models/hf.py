"""Hugging Face Llama-3.x / Qwen3 weights in and out: safetensors straight into FSDP shardings, and back.

Layouts (HF `nn.Linear` weights are `[out, in]`; jaxlong keeps heads explicit and stacks layers):

| HF tensor (per layer i: `model.layers.{i}.`)           | HF shape        | jaxlong leaf           | jaxlong shape        |
|---|---|---|---|
| `model.embed_tokens.weight`                             | `[V, D]`        | `embed`                | `[V, D]`             |
| `self_attn.q_proj.weight`                               | `[H*d, D]`      | `layers.wq`            | `[L, D, H, d]`       |
| `self_attn.k_proj.weight`, `v_proj`                     | `[H_kv*d, D]`   | `layers.wk`, `wv`      | `[L, D, H_kv, d]`    |
| `self_attn.o_proj.weight`                               | `[D, H*d]`      | `layers.wo`            | `[L, H, d, D]`       |
| `self_attn.q_norm.weight`, `k_norm` (Qwen3)             | `[d]`           | `layers.q_norm`, `k_norm` | `[L, d]`          |
| `mlp.gate_proj.weight`, `up_proj`                       | `[F, D]`        | `layers.w_gate`, `w_up`| `[L, D, F]`          |
| `mlp.down_proj.weight`                                  | `[D, F]`        | `layers.w_down`        | `[L, F, D]`          |
| `input_layernorm.weight`, `post_attention_layernorm`    | `[D]`           | `layers.attn_norm`, `mlp_norm` | `[L, D]`     |
| `model.norm.weight`                                     | `[D]`           | `final_norm`           | `[D]`                |
| `lm_head.weight` (absent when tied)                     | `[V, D]`        | `lm_head`              | `[D, V]`             |

HF's RoPE pairs dimension i with i + d/2 (`rotate_half`), as `jaxlong.layers.blocks.apply_rope` does, so no
permutation of the q/k rows is needed.

Import (`load_params`): every parameter is created with `jax.make_array_from_callback` in its FSDP sharding,
one layer of one tensor at a time: each device's callback reads only its slice of the memory-mapped file
(`safe_open(...).get_slice(name)[rows, cols]`), converts the layout and dtype, and the layer is written into
the stacked `[L, ...]` array on the devices (a donated in-place update). The host therefore never holds more
than one HF tensor (the devices' slices of it together), whatever the model size. `check_checkpoint` finds
missing, extra and mis-shaped tensors and a tokenizer larger than the embedding before anything compiles.

Export (`save_hf`): one HF tensor at a time is gathered to the host and converted back; shards of at most
`max_shard_bytes` are written as `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import tree_shardings
from jaxlong.data.imported import FILES as IMPORTED_FILES
from jaxlong.data.tokenizer import HFTokenizer
from jaxlong.models.config import ModelConfig
from jaxlong.models.hf_config import hf_config_dict, read_config_json
from jaxlong.models.llama import abstract_params

# jaxlong leaf -> (HF name, layout). Layer leaves use "{i}" in the name.
LAYER = "model.layers.{i}."
LEAVES = {
    "embed": ("model.embed_tokens.weight", "copy"),
    "final_norm": ("model.norm.weight", "copy"),
    "lm_head": ("lm_head.weight", "T"),
    "layers.attn_norm": (LAYER + "input_layernorm.weight", "copy"),
    "layers.mlp_norm": (LAYER + "post_attention_layernorm.weight", "copy"),
    "layers.wq": (LAYER + "self_attn.q_proj.weight", "in_heads"),
    "layers.wk": (LAYER + "self_attn.k_proj.weight", "in_heads"),
    "layers.wv": (LAYER + "self_attn.v_proj.weight", "in_heads"),
    "layers.wo": (LAYER + "self_attn.o_proj.weight", "out_heads"),
    "layers.q_norm": (LAYER + "self_attn.q_norm.weight", "copy"),
    "layers.k_norm": (LAYER + "self_attn.k_norm.weight", "copy"),
    "layers.w_gate": (LAYER + "mlp.gate_proj.weight", "T"),
    "layers.w_up": (LAYER + "mlp.up_proj.weight", "T"),
    "layers.w_down": (LAYER + "mlp.down_proj.weight", "T"),
}
# Gemma 3's names where they differ (`model.family=gemma3`: a norm before and after the attention and the MLP).
GEMMA3_LEAVES = {
    "layers.mlp_norm": (LAYER + "pre_feedforward_layernorm.weight", "copy"),
    "layers.post_attn_norm": (LAYER + "post_attention_layernorm.weight", "copy"),
    "layers.post_mlp_norm": (LAYER + "post_feedforward_layernorm.weight", "copy"),
}
# Tensors some checkpoints carry that hold nothing jaxlong needs.
IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
# Where a multimodal Gemma 3 checkpoint keeps its language model: the Hub's files and transformers 5's
# `save_pretrained` hold `language_model.model.*`; transformers >= 4.52 names the module `model.language_model.*`,
# which files saved from it may hold. The vision tower is left out.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.")
VISION_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def text_prefix(names) -> str:
    """The prefix of the language model's tensors among a checkpoint's tensor `names`: `model.` (a text model), or
    where a multimodal Gemma 3 checkpoint keeps it (`TEXT_PREFIXES`)."""
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in names:
            return prefix
    return "model."


def _hf_shape(ours: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The HF shape of one (per-layer) jaxlong leaf shape."""
    if layout == "copy":
        return ours
    if layout == "T":
        return ours[::-1]
    if layout == "in_heads":  # [D, n, d] <- [n*d, D]
        return (ours[1] * ours[2], ours[0])
    return (ours[2], ours[0] * ours[1])  # out_heads: [n, d, D] <- [D, n*d]


def _by_path(tree) -> dict:
    """The leaves of `tree` by dotted path (`layers.wq`)."""
    return {".".join(str(getattr(k, "key", k)) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def expected_tensors(abstract: dict, family: str = "llama",
                     prefix: str = "model.") -> dict[str, tuple[str, str, int | None, tuple]]:
    """HF tensor name -> (jaxlong leaf path, layout, layer index or None, HF shape), from the abstract params of a
    model `family`; the language model's names under `prefix` (`text_prefix`)."""
    names = {**LEAVES, **GEMMA3_LEAVES} if family == "gemma3" else LEAVES  # jaxlong leaf -> (HF name, layout)
    out = {}
    for path, leaf in _by_path(abstract).items():
        if path not in names:
            raise ValueError(f"no Hugging Face name for parameter {path}")
        name, layout = names[path]
        if name.startswith("model.") and prefix != "model.":
            name = prefix + name[len("model."):]
        if path.startswith("layers."):
            for i in range(leaf.shape[0]):
                out[name.format(i=i)] = (path, layout, i, _hf_shape(tuple(leaf.shape[1:]), layout))
        else:
            out[name] = (path, layout, None, _hf_shape(tuple(leaf.shape), layout))
    return out


class SafetensorsReader:
    """Memory-mapped tensors of a checkpoint directory's `*.safetensors` files (with or without
    `model.safetensors.index.json`). `read(name, rows, cols)` returns one slice as numpy.

    Raises:
      ConfigError: no safetensors file in the directory.
    """

    def __init__(self, directory: str | Path):
        from safetensors import safe_open  # noqa: PLC0415

        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"model.from_hf={str(directory)!r}: no *.safetensors files in that directory")
        self._files = {f.name: safe_open(str(f), framework="numpy") for f in files}
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            self.where = dict(json.loads(index.read_text())["weight_map"])
        else:
            self.where = {k: name for name, f in self._files.items() for k in f.keys()}

    def names(self) -> set[str]:
        return set(self.where)

    def _slice(self, name: str):
        return self._files[self.where[name]].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """The slice `index` (one slice per dimension) of tensor `name`; only those bytes are read."""
        return self._slice(name)[index]


def check_checkpoint(directory: str | Path, model: ModelConfig, reader: SafetensorsReader | None = None) -> None:
    """Check a checkpoint against the model it must fill (`model`, the model section), before anything compiles.

    Raises:
      ConfigError: a tensor the model needs is missing, a tensor the model does not have is present (both
        named), a tensor's shape differs from the one config.json implies, or the tokenizer has more tokens
        than the embedding rows.
    """

    reader = reader or SafetensorsReader(directory)
    where = f"model.from_hf={str(directory)!r}"
    have = reader.names()
    prefix = text_prefix(have)
    want = expected_tensors(abstract_params(model), model.family, prefix)
    ignorable = {n for n in have if n.endswith(IGNORABLE_SUFFIXES)}
    if prefix != "model.":  # the vision tower is left out
        ignorable |= {n for n in have if n.startswith(VISION_PREFIXES) or n == "language_model.lm_head.weight"}
    if model.tie_embeddings:
        ignorable.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    missing = sorted(set(want) - have)
    extra = sorted(have - set(want) - ignorable)
    if missing:
        raise ConfigError(f"{where}: tensors missing from the safetensors files: {', '.join(missing[:8])}"
                          + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    if extra:
        kind = model.family if model.family != "llama" else "qwen3" if model.qk_norm else "llama"
        raise ConfigError(f"{where}: tensors the {kind} model does not have: "
                          f"{', '.join(extra[:8])}" + (f" and {len(extra) - 8} more" if len(extra) > 8 else ""))
    for name, (_, _, _, shape) in want.items():
        got = reader.shape(name)
        if got != shape:
            raise ConfigError(f"{where}: tensor {name} has shape {list(got)} but config.json implies {list(shape)}")
    if (Path(directory) / "tokenizer.json").is_file():
        vocab = HFTokenizer(directory, option="model.from_hf").vocab_size
        if vocab > model.vocab_size:
            raise ConfigError(f"{where}: tokenizer.json has {vocab} tokens but the embedding has "
                              f"{model.vocab_size} rows (vocab_size in config.json)")


def _norm(index: tuple, shape: tuple) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _read_ours(reader, name: str, layout: str, ours_shape: tuple, index: tuple) -> np.ndarray:
    """The block `index` of jaxlong's layout of HF tensor `name`, reading only the rows/columns it needs."""
    idx = _norm(index, ours_shape)
    if layout == "copy":
        return reader.read(name, idx)
    if layout == "T":
        return reader.read(name, idx[::-1]).T
    if layout == "in_heads":  # ours [D, n, d]
        sa, sh, se = idx
        d = ours_shape[2]
        block = reader.read(name, (slice(sh.start * d, sh.stop * d), sa))  # [nh*d, Da]
        return block.T.reshape(sa.stop - sa.start, sh.stop - sh.start, d)[:, :, se]
    sh, se, sa = idx  # out_heads: ours [n, d, D]
    d = ours_shape[1]
    block = reader.read(name, (sa, slice(sh.start * d, sh.stop * d)))  # [Da, nh*d]
    return block.T.reshape(sh.stop - sh.start, d, sa.stop - sa.start)[:, se, :]


def _load_one(reader, name, layout, shape, sharding, dtype) -> jax.Array:
    """One HF tensor as a jax.Array of jaxlong shape `shape` in `sharding`; devices with the same block share
    one host read."""
    cache: dict = {}

    def callback(index):
        key = tuple((s.start, s.stop) for s in _norm(index, shape))
        if key not in cache:
            cache[key] = np.ascontiguousarray(_read_ours(reader, name, layout, shape, index).astype(dtype))
        return cache[key]

    arr = jax.make_array_from_callback(shape, sharding, callback)
    cache.clear()
    return arr


def load_params(directory: str | Path, model: ModelConfig, mesh: jax.sharding.Mesh, param_dtype: str = "float32",
                reader: SafetensorsReader | None = None) -> dict:
    """The parameters of a Hugging Face checkpoint, created directly in their FSDP shardings.

    Args:
      directory: checkpoint directory (config.json, *.safetensors); `model` must describe it
        (`jaxlong.config.model_config_from_hf`).
      model: the model section (shapes).
      mesh: the run's mesh (`jaxlong.core.mesh.tree_shardings` gives each leaf's sharding).
      param_dtype: the parameters' dtype (`param_dtype`: bf16 or fp32 files are converted to it).
      reader: where tensors are read from (default: `SafetensorsReader(directory)`).

    Returns:
      the params dict of `jaxlong.models.llama.init_params`' structure (stacked `[layers, ...]` decoder leaves).

    Raises:
      ConfigError: see `check_checkpoint` (checked first).
    """

    reader = reader or SafetensorsReader(directory)
    check_checkpoint(directory, model, reader)
    abstract = abstract_params(model, param_dtype)
    shardings = tree_shardings(mesh, abstract)
    dtype = np.dtype(jnp.dtype(param_dtype))
    by_leaf: dict[str, list] = {}
    prefix = text_prefix(reader.names())
    for name, (path, layout, layer, _) in expected_tensors(abstract, model.family, prefix).items():
        by_leaf.setdefault(path, []).append((layer, name, layout))
    leaves, sharding_of = _by_path(abstract), _by_path(shardings)
    out: dict = {}
    for path, entries in by_leaf.items():
        leaf, sharding = leaves[path], sharding_of[path]
        if path.startswith("layers."):
            layer_sharding = NamedSharding(mesh, P(*tuple(sharding.spec)[1:]))
            stacked = jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=sharding)()
            put = jax.jit(lambda buf, x, i: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0),
                          out_shardings=sharding, donate_argnums=0)
            for layer, name, layout in sorted(entries):
                one = _load_one(reader, name, layout, tuple(leaf.shape[1:]), layer_sharding, dtype)
                stacked = put(stacked, one, layer)
                del one
            value = stacked
        else:
            (_, name, layout), = entries
            value = _load_one(reader, name, layout, tuple(leaf.shape), sharding, dtype)
        target = out
        *parents, last = path.split(".")
        for p in parents:
            target = target.setdefault(p, {})
        target[last] = value
    return out


def _to_hf(x: np.ndarray, layout: str) -> np.ndarray:
    """One per-layer jaxlong array back to the HF layout."""
    if layout == "copy":
        return x
    if layout == "T":
        return np.ascontiguousarray(x.T)
    if layout == "in_heads":  # [D, n, d] -> [n*d, D]
        return np.ascontiguousarray(x.reshape(x.shape[0], -1).T)
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T)  # out_heads: [n, d, D] -> [D, n*d]


def _file_mode() -> int:
    """The mode a plain file write gives a new file: 0666 less the process's umask."""
    umask = os.umask(0o022)  # reading the umask means setting it: set it back at once
    os.umask(umask)
    return 0o666 & ~umask


def save_hf(params: dict, model: ModelConfig, out: str | Path, *, seq_len: int, param_dtype: str,
            source: str | Path | None = None, max_shard_bytes: int = 2 << 30) -> Path:
    """Write `params` as a Hugging Face checkpoint directory `transformers.AutoModelForCausalLM` loads.

    Writes `config.json` (`hf_config_dict`: model_type `gemma3_text` for `model.family=gemma3` (the text model
    alone), `qwen3` when `model.qk_norm`, else `llama`;
    `max_position_embeddings` = max(`seq_len`, the checkpoint's), RoPE theta and scaling of the run), the
    weights in `param_dtype` as `model-0000k-of-0000n.safetensors` shards of at most `max_shard_bytes` with
    `model.safetensors.index.json`, and, from `source` (the run's tokenizer directory,
    `jaxlong.data.tokenizer_source`: its copy in `RUN_DIR/imported/`, if any), the tokenizer files, the chat
    template (`chat_template.jinja`, or the one in `tokenizer_config.json`), `generation_config.json` and the token
    ids of its config.json: what transformers needs to load the model and its tokenizer and apply the template. One tensor at a time is gathered to the host. Every
    file gets the mode of a plain file write (0666 less the umask: 0644 under the usual umask 022).

    Raises:
      FileExistsError: `out` exists and is not empty.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out}: the directory exists and is not empty; choose a new one")
    out.mkdir(parents=True, exist_ok=True)
    m = model
    model_type = "gemma3_text" if m.family == "gemma3" else "qwen3" if m.qk_norm else "llama"
    config = hf_config_dict(m, model_type=model_type, context=max(seq_len, m.max_position_embeddings),
                            dtype=param_dtype)
    if source is not None:
        if (Path(source) / "config.json").is_file():
            src = read_config_json(source)
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if key in src:
                    config[key] = src[key]
        for f in IMPORTED_FILES:
            if f != "config.json" and (Path(source) / f).is_file():  # a new file (the umask's mode)
                shutil.copyfile(Path(source) / f, out / f)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    flat = _by_path(params)
    want = expected_tensors(abstract_params(m, param_dtype), m.family)
    itemsize = jnp.dtype(param_dtype).itemsize
    shards: list[list[str]] = [[]]  # planned from the shapes, so only one shard is ever on the host
    size = 0
    for name, (_, _, _, shape) in want.items():
        nbytes = int(np.prod(shape)) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name in names:
            path, layout, layer, _ = want[name]
            leaf = flat[path]
            tensors[name] = _to_hf(np.asarray(jax.device_get(leaf if layer is None else leaf[layer])), layout)
            weight_map[name] = fname
            total += tensors[name].nbytes
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        os.chmod(out / fname, _file_mode())  # safetensors writes through a private (0600) temporary file
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out

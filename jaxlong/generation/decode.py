"""Prefill and cached decode on the training mesh, with split-KV attention across the sequence shards.

**Prefill** is the training forward (`jaxlong.models.llama.Llama.prefill`) on the run's mesh and attention method
(FSDP, Ulysses, U-Pipe, ring and their hybrids). Each layer's post-RoPE keys and values are computed from the
layer's input where the layer holds it, split by sequence over `ring x context` (in ring attention's zigzag
order when ring > 1), and stay there: the prompt cache `[layers, batch, kv_heads, prompt, head_dim]` (head-major:
each head's keys are read contiguously, the cache is never transposed), sharded `P(None, (data, fsdp), None,
(ring, context))`. One cache path serves every attention method; the methods' own code
(`jaxlong.parallel.ulysses`, `upipe`, `ring`) is not touched.

**Decode** (one token per row and step) is flash-decoding (Dao et al., "Flash-Decoding for long-context
inference", 2023; vLLM's decode context parallelism): each device scores the new token's queries against its
own slice of the prompt cache and returns a partial output with its log-sum-exp; the slices merge exactly with
two small collectives per layer (`pmax` of the maxima, `psum` of the rescaled outputs and sums) over the sequence
axes. The generated tokens' own keys and values go into a small cache `[layers, batch, max_new, kv_heads,
head_dim]`, replicated over the sequence axes (each device holds the same, counted once), merged after the
cross-device merge. The step reads the weights where `decode_weights` puts them
(`jaxlong.generation.generate.Generator.decode_params`): whole on every device in the compute dtype, gathered once
before decoding, so the step moves no weights; or FSDP-sharded as trained, each layer's gathered for every token as
in the train step (the least memory), the embedding and the output head used sharded (one row looked up, the logits
computed where the vocabulary lies). Positions are true global positions (each row's prompt length onward); padding
is masked out of the prompt cache by `valid`.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import runtime
from jaxlong.core.mesh import BATCH_AXES, RING_AXIS, SEQ_AXES, axis_size
from jaxlong.core.batch import zigzag_order
from jaxlong.kernels.merge import NEG, merge, merge_across, normalise
from jaxlong.models.family import LOCAL
from jaxlong.models import llama as model_lib


__all__ = ["Cache", "Sampling", "make_prefill", "make_decode_step", "cache_shardings", "sample", "output_head",
           "decode_weights_mode", "replicate_weights", "weight_bytes"]



class Cache(NamedTuple):
    """The KV cache of a batch being generated.

    Attributes:
      k, v: the prompt's post-RoPE keys and values `[layers, batch, kv_heads, prompt, head_dim]` (compute dtype),
        sharded by batch over data x fsdp and by sequence over ring x context (zigzag order when ring > 1).
      valid: bool `[batch, prompt]`, sharded like the tokens: False at padding.
      new_k, new_v: the generated tokens' keys and values `[layers, batch, kv_heads, max_new, head_dim]`, batch over
        data x fsdp, replicated over the sequence axes; slot t holds the t-th generated token's (the token fed at
        decode step t).
      pos: int32 `[batch, prompt]`, sharded like `valid`: each prompt key's position (a sliding-window layer's
        query at position p sees the keys at positions above p - window).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    new_k: jax.Array
    new_v: jax.Array
    pos: jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: `temperature` 0 is greedy (argmax); otherwise softmax of
    logits / temperature restricted to the `top_k` most likely tokens (0: all) and to the smallest set whose
    probability reaches `top_p` (1: all), drawn with the step's key."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def sample(logits: jax.Array, key: jax.Array, s: Sampling, vocab: int | None = None) -> jax.Array:
    """The next token `[batch]` int32 from float32 `logits` `[batch, vocab]` under `s` (`Sampling`); ids from `vocab`
    on (the padded embedding's rows no token has) are never drawn."""
    if vocab is not None and vocab < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)
    if s.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        sorted_logits = jnp.where(before >= s.top_p, -jnp.inf, sorted_logits)  # the top token always stays
        logits = jnp.full_like(logits, -jnp.inf).at[jnp.arange(logits.shape[0])[:, None], order].set(sorted_logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _specs():
    big = P(None, BATCH_AXES, None, SEQ_AXES, None)
    small = P(None, BATCH_AXES, None, None, None)
    return Cache(big, big, P(BATCH_AXES, SEQ_AXES), small, small, P(BATCH_AXES, SEQ_AXES))


def cache_shardings(mesh: jax.sharding.Mesh) -> Cache:
    """The `NamedSharding` of each `Cache` field on `mesh`."""
    return Cache(*(NamedSharding(mesh, s) for s in _specs()))


def output_head(params: dict, cfg) -> jax.Array:
    """The output projection `[hidden, vocab]` of the parameter dict (the embedding's transpose when tied)."""
    return params["embed"].T if cfg.model.tie_embeddings else params["lm_head"]


def make_prefill(cfg, mesh: jax.sharding.Mesh, max_new: int):
    """`prefill(params, batch) -> (logits [batch, vocab] float32, Cache)`, jitted: the forward of the prompts
    `batch` (`inputs`, `positions`, `segment_ids` `[batch, prompt]` int32 in the train step's input layout,
    `jaxlong.core.batch.put_batch`: left-padded, padding with segment id 0) on `mesh`, the logits of each
    row's last token (the prompt's last slot), and the cache with room for `max_new` generated tokens.

    `cfg.seq_len` is ignored: the prompt length is the batch's (one compile per batch shape)."""
    # The prompts' padding is masked by segment ids, so the attention kernel must take them (`auto` picks the
    # Pallas kernel on GPUs, as for packed documents, instead of cuDNN, which cannot mask them).
    rt = dataclasses.replace(runtime(cfg, mesh), document_masking=True)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    m, cd = cfg.model, jnp.dtype(cfg.compute_dtype)
    ring = axis_size(mesh, RING_AXIS)

    def prefill(params, batch):
        model = nnx.merge(graphdef, params)
        hidden, k, v = model.prefill(batch["inputs"], rt, batch["positions"], batch["segment_ids"])
        s = batch["inputs"].shape[1]
        last = int(np.argsort(zigzag_order(s, ring))[s - 1])  # the slot of the last token in the input layout
        h = rt.constrain(hidden[:, last], P(BATCH_AXES, None))
        logits = jnp.einsum("bh,hv->bv", h, rt.gather(output_head(params, cfg))).astype(jnp.float32)
        b = batch["inputs"].shape[0]
        small = jnp.zeros((m.layers, b, m.kv_heads, max_new, m.head_dim), cd)
        return logits, Cache(k, v, batch["segment_ids"] > 0, small, small, batch["positions"].astype(jnp.int32))

    return jax.jit(prefill, out_shardings=(NamedSharding(mesh, P(BATCH_AXES, None)), cache_shardings(mesh)))


def weight_bytes(params: dict, cfg) -> int:
    """Bytes of the whole weights `params` in the compute dtype: what `replicate_weights` puts on each device (the
    norms' scales, which it keeps as they are, counted in the compute dtype too: a few KiB)."""
    return sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params)) * jnp.dtype(cfg.compute_dtype).itemsize


def decode_weights_mode(setting: str, need: int, free: int | None) -> str:
    """Where the decode step reads the weights: `setting` (`decode_weights`) when it names `replicated` or
    `sharded`; for `auto`, `replicated` when the whole weights (`need` bytes per device, `weight_bytes`) take at
    most half of each device's `free` bytes (`jaxlong.core.memstats.free_per_device`, read after the prefill, the
    cache allocated), else `sharded` (also where `free` is unknown)."""
    if setting != "auto":
        return setting
    return "replicated" if free is not None and need <= free // 2 else "sharded"


def replicate_weights(cfg, mesh: jax.sharding.Mesh):
    """`replicate(params) -> params` whole on every device of `mesh` (one gather), jitted: the matrices in the
    compute dtype as the decode step's per-token gather casts them and the norms' scales as they are, so decoding
    gives the same numbers up to the order of the output head's sums (tied embeddings: within 1e-7 in float32)."""
    cd = jnp.dtype(cfg.compute_dtype)

    def cast(path, a):
        return a if "norm" in jax.tree_util.keystr(path) else a.astype(cd)

    return jax.jit(lambda p: jax.tree_util.tree_map_with_path(cast, p), out_shardings=NamedSharding(mesh, P()))


def _partial(q, k, v, valid):
    """One shard's attention of the new queries `q` `[b, kv, g, d]` (float32, scaled) over its keys and values
    `[b, kv, n, d]` with `valid` `[b, n]`: (output `[b, kv, g, d]` float32, log-sum-exp `[b, kv, g]`; `NEG` where no
    key is valid), for `jaxlong.kernels.merge`."""
    s = jnp.einsum("bkgd,bknd->bkgn", q, k.astype(jnp.float32))
    s = jnp.where(valid[:, None, None, :], s, NEG)
    mx = jnp.max(s, axis=-1)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - mx[..., None]), 0.0)
    return normalise(jnp.einsum("bkgn,bknd->bkgd", p, v.astype(jnp.float32)), mx, jnp.sum(p, axis=-1))


def make_decode_step(cfg, mesh: jax.sharding.Mesh, sampling: Sampling = Sampling(), vocab: int | None = None):
    """`step(params, cache, tokens [b], positions [b], t, key) -> (next tokens [b] int32, logits [b, vocab]
    float32, cache)`, jitted with the cache donated: compiled once per batch size, cache size and placement of the
    weights (`decode_weights`), whatever the step.

    Feeds `tokens` (each row's newest token) at global `positions`, writes their keys and values into slot `t` of
    the small cache, attends to the valid prompt cache (split-KV over the sequence shards, merged exactly with a
    `pmax` and a `psum`) and to the small cache's slots `<= t` (a sliding-window layer to the keys within its window
    of positions), runs the layer's MLP, and draws the next token (`sample`, ids from `vocab` on never drawn)."""
    m, cd = cfg.model, jnp.dtype(cfg.compute_dtype)
    rt = runtime(cfg, mesh)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    group = m.heads // m.kv_heads
    scale = 1.0 / float(np.sqrt(m.head_dim))
    seq = tuple(a for a in SEQ_AXES if axis_size(mesh, a) > 1)

    def shard_attention(q, k, v, valid):
        o, lse = _partial(q, k, v, valid)
        return merge_across(o, lse, seq) if seq else (o, lse)

    batch_q = P(BATCH_AXES, None, None, None)
    prompt_attention = jax.shard_map(
        shard_attention, mesh=mesh, check_vma=False,
        in_specs=(batch_q, P(BATCH_AXES, None, SEQ_AXES, None), P(BATCH_AXES, None, SEQ_AXES, None),
                  P(BATCH_AXES, SEQ_AXES)),
        out_specs=(batch_q, P(BATCH_AXES, None, None)))

    def step(params, cache: Cache, tokens, positions, t, key):
        b = tokens.shape[0]
        model = nnx.merge(graphdef, params)
        tokens = rt.constrain(tokens, P(BATCH_AXES))  # replicated between steps; looked up per batch shard
        x = model.embed_tokens(tokens[:, None], rt, gather=False)  # [b, 1, hidden]: rows of the shards
        x = rt.constrain(x, P(BATCH_AXES, None, None))
        pos = positions[:, None].astype(jnp.int32)
        slots = jnp.arange(cache.new_k.shape[3])
        seen = (slots <= t)[None, :].repeat(b, 0)
        local = jnp.asarray(rt.kinds) == LOCAL  # [layers]
        window = m.sliding_window or 1  # a local layer's query at p sees positions p - window + 1 .. p

        def attend(q, k, v, i, new, prompt):
            """Write the token's k, v into slot t of layer i's small cache; attend to the prompt cache and to it."""
            new_k, new_v = (jax.lax.dynamic_update_slice(c, jnp.swapaxes(a, 1, 2)[None].astype(cd), (i, 0, 0, t, 0))
                            for c, a in zip(new, (k, v)))
            qg = (q[:, 0].astype(jnp.float32) * scale).reshape(b, m.kv_heads, group, m.head_dim)
            valid, seen_i = cache.valid, seen
            if m.sliding_window:  # slot j of the small cache holds position p - (t - j)
                valid = valid & ((cache.pos > pos - window) | ~local[i])
                seen_i = seen & ((slots > t - window)[None, :] | ~local[i])
            attn, _ = merge([prompt_attention(qg, *prompt, valid), _partial(qg, new_k[i], new_v[i], seen_i)])
            return attn.reshape(b, 1, m.heads, m.head_dim).astype(cd), (new_k, new_v)

        x, (new_k, new_v) = model.cached_layers(x, pos, rt, attend, (cache.new_k, cache.new_v),
                                                xs=(cache.k, cache.v), spec=P(BATCH_AXES, None, None))
        h = model.final(x[:, 0])
        logits = jnp.einsum("bh,hv->bv", h, output_head(params, cfg).astype(cd)).astype(jnp.float32)  # head sharded
        logits = rt.constrain(logits, P(BATCH_AXES, None))
        nxt = sample(logits, key, sampling, vocab)
        return nxt, logits, cache._replace(new_k=new_k, new_v=new_v)

    # the next tokens replicated (`[b]` int32): every process reads them, when the batch axes span processes too
    out = (NamedSharding(mesh, P()), NamedSharding(mesh, P(BATCH_AXES, None)), cache_shardings(mesh))
    return jax.jit(step, donate_argnums=(1,), out_shardings=out)

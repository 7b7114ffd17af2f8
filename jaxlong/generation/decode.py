"""Prefill and cached decode on the training mesh, with split-KV attention across the sequence shards.

**Prefill** is the training forward (`jaxlong.models.llama.Llama.prefill`) on the run's mesh and attention method
(FSDP, Ulysses, U-Pipe, ring and their hybrids). Each layer's post-RoPE keys and values are computed from the
layer's input where the layer holds it, split by sequence over `ring x context` (in ring attention's zigzag
order when ring > 1), and stay there: the prompt cache `[global layers, batch, kv_heads, prompt, head_dim]`
(head-major: each head's keys are read contiguously, the cache is never transposed), sharded `P(None, (data, fsdp),
None, (ring, context))`. One cache path serves every attention method; the methods' own code
(`jaxlong.parallel.ulysses`, `upipe`, `ring`) is not touched.

**Decode** (one token per row and step) is flash-decoding (Dao et al., "Flash-Decoding for long-context
inference", 2023; vLLM's decode context parallelism): each device scores the new token's queries against its
own slice of the prompt cache and returns a partial output with its log-sum-exp; the slices merge exactly with
two small collectives per layer (`pmax` of the maxima, `psum` of the rescaled outputs and sums) over the sequence
axes. The generated tokens' own keys and values go into a small cache `[global layers, batch, kv_heads, max_new,
head_dim]`, replicated over the sequence axes (each device holds the same, counted once), merged after the
cross-device merge.

**Sliding-window layers** (Gemma 3's local layers, `model.sliding_window` = W: a query sees itself and the W - 1
positions before it) never read further back than W positions, so their cache holds only those: a ring buffer of W
slots per local layer `[local_layers, batch, kv_heads, W, head_dim]`, replicated over the sequence axes like the
generated tokens' cache (a few MiB where the prompt cache is GiB). After the prefill, slot s holds the prompt's
position `n - W + s` (n the row's prompt length); the t-th generated token (position `n + t`) overwrites slot
`t mod W`, the position that has just left the window. Only the global layers keep the prompt cache split over the
devices and the small cache of generated tokens (`Cache`): the two kinds' caches are two stacks, indexed by each
layer's place among the layers of its kind (`stack_index`), and the decode step's one layer scan switches on the
layer's kind (`lax.switch`, as the training forward does) between the global layer's split-KV attention and the
local layer's attention over its window (no collective). `cache_shapes` gives the cache's shapes and shardings.

The step reads the weights where `decode_weights` puts them
(`jaxlong.generation.generate.Generator.decode_params`): whole on every device in the compute dtype, gathered once
before decoding, so the step moves no weights; or FSDP-sharded as trained, each layer's gathered for every token as
in the train step (the least memory), the embedding and the output head used sharded (one row looked up, the logits
computed where the vocabulary lies). Positions are true global positions (each row's prompt length onward); padding
is masked out of the prompt cache by `valid`.
"""

from __future__ import annotations

import dataclasses
import functools
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
from jaxlong.models.family import GLOBAL, LOCAL, layer_kinds
from jaxlong.models import llama as model_lib


__all__ = ["Cache", "Sampling", "make_prefill", "make_decode_step", "expand_samples", "cache_shardings", "cache_shapes",
           "cache_bytes", "stack_index", "by_kind", "window_gather", "zigzag_slot", "sample", "output_head",
           "decode_weights_mode", "replicate_weights", "weight_bytes"]


class Cache(NamedTuple):
    """The KV cache of a batch being generated: the global layers' (`g` of them) and the sliding-window layers' (`l`)
    in two stacks (`stack_index` gives a layer's place in its kind's stack; a family without windows has `l` = 0).

    Attributes:
      k, v: the global layers' prompt keys and values, post-RoPE, `[g, batch, kv_heads, prompt, head_dim]` (compute
        dtype), sharded by batch over data x fsdp and by sequence over ring x context (the prefill's layout: zigzag
        order when ring > 1, `jaxlong.generation.chunked.chunk_order` after a chunked prefill).
      valid: bool `[batch, prompt]`, sharded like the tokens: False at padding.
      new_k, new_v: the global layers' keys and values of the generated tokens `[g, batch, kv_heads, max_new,
        head_dim]`, batch over data x fsdp, replicated over the sequence axes; slot t holds the t-th generated
        token's (the token fed at decode step t).
      win_k, win_v: the sliding-window layers' ring buffers `[l, batch, kv_heads, window, head_dim]`, batch over
        data x fsdp, replicated over the sequence axes: slot s holds, before decode step t, the row's position
        `n + t - 1 - ((t - 1 - s) mod window)` (n its prompt length; zero and never read where that is negative).
    """

    k: jax.Array
    v: jax.Array
    valid: jax.Array
    new_k: jax.Array
    new_v: jax.Array
    win_k: jax.Array
    win_v: jax.Array


def stack_index(m) -> tuple[np.ndarray, np.ndarray]:
    """`(kinds, index)` of the model section `m`: each layer's kind (`GLOBAL`, `LOCAL`) `[layers]` and its place among
    the layers of its kind `[layers]` (its layer of the `Cache`'s global or window stack), int32 numpy."""
    kinds = np.asarray(layer_kinds(m), np.int32)
    index = np.zeros_like(kinds)
    for kind in (GLOBAL, LOCAL):
        index[kinds == kind] = np.arange(int((kinds == kind).sum()))
    return kinds, index


def by_kind(kinds: np.ndarray, i: jax.Array, fn, *args):
    """`fn(kind, *args)` for layer `i`'s (traced int32) kind: called as is where every layer is of one kind, else
    a `lax.switch` between the kinds' branches."""
    present = [kind for kind in (GLOBAL, LOCAL) if kind in kinds]
    if len(present) == 1:
        return fn(present[0], *args)
    return jax.lax.switch(jnp.asarray(kinds)[i], [functools.partial(fn, GLOBAL), functools.partial(fn, LOCAL)], *args)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: `temperature` 0 is greedy (argmax); otherwise softmax of
    logits / temperature restricted to the `top_k` most likely tokens (0: all) and to the smallest set whose
    probability reaches `top_p` (1: all), drawn with the step's key. `n`: the rows drawn from each prompt, all
    decoding from its one prompt cache (vLLM's `SamplingParams.n`; GRPO's group, TRL's `num_generations`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1


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
    return Cache(big, big, P(BATCH_AXES, SEQ_AXES), small, small, small, small)


def cache_shardings(mesh: jax.sharding.Mesh) -> Cache:
    """The `NamedSharding` of each `Cache` field on `mesh`."""
    return Cache(*(NamedSharding(mesh, s) for s in _specs()))


def cache_shapes(cfg, mesh: jax.sharding.Mesh, rows: int, prompt: int, max_new: int) -> Cache:
    """The `Cache` of `rows` prompts of `prompt` tokens (padded) with room for `max_new` generated tokens, as
    `jax.ShapeDtypeStruct`s with their shardings on `mesh` (nothing allocated): what the prefills return and the
    decode step takes. The global layers' fields grow with `prompt` and `max_new`, the window layers' are `window`
    slots whatever the lengths."""
    m, cd = cfg.model, jnp.dtype(cfg.compute_dtype)
    kinds, _ = stack_index(m)
    g, l = int((kinds == GLOBAL).sum()), int((kinds == LOCAL).sum())
    big, new, win = ((n, rows, m.kv_heads, s, m.head_dim)
                     for n, s in ((g, prompt), (g, max_new), (l, m.sliding_window)))
    shapes = Cache(big, big, (rows, prompt), new, new, win, win)
    dtypes = Cache(cd, cd, jnp.dtype(bool), cd, cd, cd, cd)
    return Cache(*(jax.ShapeDtypeStruct(a, d, sharding=h) for a, d, h in zip(shapes, dtypes, cache_shardings(mesh))))


def cache_bytes(cache: Cache) -> dict[str, int]:
    """Bytes per device of each field of `cache` (arrays or `cache_shapes`' abstract ones): each field's shard
    shape under its sharding times its item size (a replicated field counts whole on every device)."""
    return {name: int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize
            for name, a in zip(Cache._fields, cache)}


def zigzag_slot(index: jax.Array, n: int, ring: int) -> jax.Array:
    """The slot of the zigzag layout (`jaxlong.core.batch.zigzag_order` of `n` tokens over `ring` ranks) that holds
    prompt index `index` (int32, any shape): the inverse of the order, computed (no table)."""
    if ring == 1:
        return index
    c = n // (2 * ring)
    chunk, within = index // c, index % c
    return jnp.where(chunk < ring, chunk * 2 * c + within, (2 * ring - 1 - chunk) * 2 * c + c + within)


def window_gather(mesh: jax.sharding.Mesh, window: int, slot_of):
    """`gather(k, v, last) -> (wk, wv)`: the last `window` prompt keys and values of each row, as the `Cache`'s window
    buffers (sliding-window layers), from a prompt cache in the prefill's layout.

    k, v `[layers, b, kv_heads, n, head_dim]` sharded like `Cache.k`, whose global slot `slot_of(i)` holds prompt
    index i (a jnp function: the identity, `zigzag_slot`, or the chunked prefill's order); `last` int32 `[b]` (batch
    over data x fsdp): each row's last token's prompt index. Returns `[layers, b, kv_heads, window, head_dim]`
    replicated over the sequence axes, slot s holding prompt index `last - window + 1 + s` (zero where negative).
    Each device takes the slots it holds and one `psum` over ring x context joins them (exact: one term is
    nonzero)."""
    seq = tuple(a for a in SEQ_AXES if axis_size(mesh, a) > 1)

    def gather(k, v, last):
        local_n = k.shape[3]
        dev = jax.lax.axis_index(seq) if seq else 0  # the device's index along the flattened sequence axes
        index = last[:, None] - window + 1 + jnp.arange(window)  # [b, window]
        slot = slot_of(jnp.maximum(index, 0))
        mine = (index >= 0) & (slot // local_n == dev)
        at = jnp.where(mine, slot % local_n, 0)[None, :, None, :, None]
        out = tuple(jnp.where(mine[None, :, None, :, None], jnp.take_along_axis(a, at, axis=3), 0) for a in (k, v))
        return jax.lax.psum(out, seq) if seq else out

    big, small = P(None, BATCH_AXES, None, SEQ_AXES, None), P(None, BATCH_AXES, None, None, None)
    return jax.shard_map(gather, mesh=mesh, check_vma=False, in_specs=(big, big, P(BATCH_AXES)),
                         out_specs=(small, small))


def output_head(params: dict, cfg) -> jax.Array:
    """The output projection `[hidden, vocab]` of the parameter dict (the embedding's transpose when tied)."""
    return params["embed"].T if cfg.model.tie_embeddings else params["lm_head"]


def make_prefill(cfg, mesh: jax.sharding.Mesh, max_new: int):
    """`prefill(params, batch) -> (logits [batch, vocab] float32, Cache)`, jitted: the forward of the prompts
    `batch` (`inputs`, `positions`, `segment_ids` `[batch, prompt]` int32 in the train step's input layout,
    `jaxlong.core.batch.put_batch`: left-padded, each row one document at positions 0 .. its length - 1, padding
    with segment id 0) on `mesh`, the logits of each row's last token (the prompt's last slot), and the cache with
    room for `max_new` generated tokens.

    Each layer's keys and values go straight into its kind's stack of the cache inside the layer scan: a global
    layer's whole prompt, a sliding-window layer's last `window` positions (`window_gather`), so the prefill never
    holds the window layers' whole-prompt K/V. `cfg.seq_len` is ignored: the prompt length is the batch's (one
    compile per batch shape)."""
    # The prompts' padding is masked by segment ids, so the attention kernel must take them (`auto` picks the
    # Pallas kernel on GPUs, as for packed documents, instead of cuDNN, which cannot mask them).
    rt = dataclasses.replace(runtime(cfg, mesh), document_masking=True)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    ring = axis_size(mesh, RING_AXIS)
    kinds, index = stack_index(cfg.model)

    def prefill(params, batch):
        model = nnx.merge(graphdef, params)
        b, s = batch["inputs"].shape
        empty = cache_shapes(cfg, mesh, b, s, max_new)
        gather = window_gather(mesh, cfg.model.sliding_window, lambda i: zigzag_slot(i, s, ring))
        last = jnp.full((b,), s - 1, jnp.int32)  # left-padded: every row's last token is the last prompt index

        def store(k, v, i, acc):
            """Layer i's `[b, kv, s, d]` keys and values into its stack: whole (global) or its window (local)."""
            def put(kind, acc):
                acc, at = list(acc), (jnp.asarray(index)[i], 0, 0, 0, 0)
                new = (k[None], v[None]) if kind == GLOBAL else gather(k[None], v[None], last)
                for f, a in zip((0, 1) if kind == GLOBAL else (2, 3), new):
                    acc[f] = jax.lax.dynamic_update_slice(acc[f], a, at)
                return tuple(acc)

            return by_kind(kinds, i, put, acc)

        zeros = tuple(rt.constrain(jnp.zeros(a.shape, a.dtype), a.sharding.spec)
                      for a in (empty.k, empty.v, empty.win_k, empty.win_v))
        hidden, (k, v, win_k, win_v) = model.prefill(batch["inputs"], rt, batch["positions"], batch["segment_ids"],
                                                     store=store, carry=zeros)
        last_slot = int(np.argsort(zigzag_order(s, ring))[s - 1])  # the slot of the last token in the input layout
        h = rt.constrain(hidden[:, last_slot], P(BATCH_AXES, None))
        logits = jnp.einsum("bh,hv->bv", h, rt.gather(output_head(params, cfg))).astype(jnp.float32)
        small = jnp.zeros(empty.new_k.shape, empty.new_k.dtype)
        return logits, Cache(k, v, batch["segment_ids"] > 0, small, small, win_k, win_v)

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


def expand_samples(mesh: jax.sharding.Mesh, samples: int):
    """`expand(cache) -> cache` for G = `samples` rows per prompt (`Sampling.n`), jitted: the prompt
    keys and values and `valid` stay as the prefill made them (one per prompt, never copied); the generated tokens'
    cache gets G rows per prompt (zeros), and a sliding-window layer's ring buffer (its last `window` positions, a
    few MiB) is repeated G times, each row's own from there on."""

    def expand(cache: Cache) -> Cache:
        new = jnp.zeros((*cache.new_k.shape[:1], cache.new_k.shape[1] * samples, *cache.new_k.shape[2:]),
                        cache.new_k.dtype)
        win_k, win_v = (jnp.repeat(a, samples, axis=1) for a in (cache.win_k, cache.win_v))
        return cache._replace(new_k=new, new_v=new, win_k=win_k, win_v=win_v)

    return jax.jit(expand, out_shardings=cache_shardings(mesh))


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

    `sampling.n` = G > 1 decodes G rows per prompt from one prompt cache (GRPO's group, `expand_samples`): the cache's
    prompt keys and values hold `b / G` prompts, and the G rows of prompt p (rows `p G .. p G + G - 1`) each have
    their own generated tokens' cache. A global layer scores the G rows' queries against the prompt's keys together,
    as G times as many query heads of one row, so the prompt's K/V is never copied G times.

    Feeds `tokens` (each row's newest token) at global `positions` (each row's prompt length + `t`). A global layer
    writes their keys and values into slot `t` of the small cache and attends to the valid prompt cache (split-KV
    over the sequence shards, merged exactly with a `pmax` and a `psum`) and to the small cache's slots `<= t`; a
    sliding-window layer writes them into slot `t mod window` of its ring buffer and attends to its slots holding
    positions >= 0 (all within its window). Then the layer's MLP, and the next token is drawn (`sample`, ids from
    `vocab` on never drawn). Sources: Flash-Decoding (the module docstring); Gemma 3's local layers, arXiv
    2503.19786 section 2."""
    m, cd = cfg.model, jnp.dtype(cfg.compute_dtype)
    rt = runtime(cfg, mesh)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    group = m.heads // m.kv_heads
    scale = 1.0 / float(np.sqrt(m.head_dim))
    seq = tuple(a for a in SEQ_AXES if axis_size(mesh, a) > 1)
    kinds, index = stack_index(m)
    samples = sampling.n

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
        seen = (jnp.arange(cache.new_k.shape[3]) <= t)[None, :].repeat(b, 0)
        window = max(m.sliding_window, 1)
        # slot s of a window buffer holds position pos - ((t - s) mod window) once slot t mod window is written
        held = (pos - jnp.mod(t - jnp.arange(window), window)[None, :]) >= 0  # [b, window]

        def on_prompts(qg, j):
            """The prompt cache's attention for every row: with G samples a prompt's G rows as its query heads."""
            if samples == 1:
                return prompt_attention(qg, cache.k[j], cache.v[j], cache.valid)
            n = b // samples
            q = qg.reshape(n, samples, m.kv_heads, group, m.head_dim).swapaxes(1, 2)
            o, lse = prompt_attention(q.reshape(n, m.kv_heads, samples * group, m.head_dim), cache.k[j], cache.v[j],
                                      cache.valid)
            o = o.reshape(n, m.kv_heads, samples, group, m.head_dim).swapaxes(1, 2)
            return o.reshape(qg.shape), lse.reshape(n, m.kv_heads, samples, group).swapaxes(1, 2).reshape(qg.shape[:3])

        def attend_global(qg, kv, j, carry):
            """Write into slot t of global layer j's small cache; attend to its prompt cache and to it."""
            new_k, new_v = (jax.lax.dynamic_update_slice(c, a, (j, 0, 0, t, 0)) for c, a in zip(carry[:2], kv))
            attn, _ = merge([on_prompts(qg, j), _partial(qg, new_k[j], new_v[j], seen)])
            return attn, (new_k, new_v, *carry[2:])

        def attend_local(qg, kv, j, carry):
            """Write into slot t mod window of window layer j's ring buffer; attend to it (replicated, no merge)."""
            at = (j, 0, 0, jnp.mod(t, window), 0)
            win_k, win_v = (jax.lax.dynamic_update_slice(c, a, at) for c, a in zip(carry[2:], kv))
            return _partial(qg, win_k[j], win_v[j], held)[0], (*carry[:2], win_k, win_v)

        def attend(q, k, v, i, carry, _):
            qg = (q[:, 0].astype(jnp.float32) * scale).reshape(b, m.kv_heads, group, m.head_dim)
            kv = tuple(jnp.swapaxes(a, 1, 2)[None].astype(cd) for a in (k, v))  # [1, b, kv_heads, 1, head_dim]
            branches = {GLOBAL: attend_global, LOCAL: attend_local}
            attn, carry = by_kind(kinds, i, lambda kind, *a: branches[kind](*a), qg, kv, jnp.asarray(index)[i], carry)
            return attn.reshape(b, 1, m.heads, m.head_dim).astype(cd), carry

        x, (new_k, new_v, win_k, win_v) = model.cached_layers(
            x, pos, rt, attend, (cache.new_k, cache.new_v, cache.win_k, cache.win_v), spec=P(BATCH_AXES, None, None))
        h = model.final(x[:, 0])
        logits = jnp.einsum("bh,hv->bv", h, output_head(params, cfg).astype(cd)).astype(jnp.float32)  # head sharded
        logits = rt.constrain(logits, P(BATCH_AXES, None))
        nxt = sample(logits, key, sampling, vocab)
        return nxt, logits, cache._replace(new_k=new_k, new_v=new_v, win_k=win_k, win_v=win_v)

    # the next tokens replicated (`[b]` int32): every process reads them, when the batch axes span processes too
    out = (NamedSharding(mesh, P()), NamedSharding(mesh, P(BATCH_AXES, None)), cache_shardings(mesh))
    return jax.jit(step, donate_argnums=(1,), out_shardings=out)

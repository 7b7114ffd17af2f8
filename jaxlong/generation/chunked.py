"""Chunked prefill: a long prompt's forward in chunks of `prefill_chunk` tokens, each chunk attending to the KV
cache filled so far, so that the prefill holds one chunk's activations beside the cache instead of the whole
prompt's.

The whole-prompt prefill (`jaxlong.generation.decode.make_prefill`, the training forward) holds a few
`[prompt / devices, hidden]` buffers besides the cache it fills; at 4M tokens on 8 GPUs each is 4 GiB and the
cache 64 GiB per device. Here the cache is allocated once and filled chunk by chunk (chunked prefill as in
Sarathi, Agrawal et al., arXiv 2308.16369, here on the training mesh), and each chunk's attention over it is
split-KV across the sequence shards, merged exactly, as the decode step's (Flash-Decoding) but with a chunk of
queries.

Layout. The sequence axes `ring x context` (D devices, ring-major) split each chunk of `c` tokens into D
contiguous slices of `c / D`; device d holds slice d of every chunk, so every device holds an equal share of every
chunk and the causal work is balanced. Its cache shard holds them in *descending* prompt order, chunk 0 at the
end (`chunk_order`): the keys a query may see (prompt index <= its own) are then a suffix of the shard, so the
kernel's mask is one lower bound per query (`kv_starts`) and the slots of chunks not yet written lie below every
bound. The decode step does not see the order (a new token attends to every valid prompt
key). Prompts are right-padded here (the padding after every real token: no real query sees it).

Per layer and chunk `j`:
  1. q, k, v of each device's slice (weights FSDP-gathered per layer, as in the train step), RoPE at the prompt's
     true positions; k and v of padding zeroed (and masked by `valid` in the decode step).
  2. k and v written into the local cache at their slots, in place (the cache is donated).
  3. the chunk's queries all-gathered over the sequence axes; each device attends them to its cache shard by
     the attention kernel (`jaxlong.kernels.backend.attention_fwd_with_lse`, FlashAttention-2's forward, arXiv
     2307.08691, Alg. 1: the Pallas kernel on GPUs, the blockwise kernel elsewhere), reading the head-major cache
     in place, each query to the keys of prompt index <= its own (`kv_starts`): a partial output with its
     log-sum-exp. The kernel's loop bounds skip the key tiles below a query tile's least bound: the slots of the
     chunks not yet written.
  4. the partials merged exactly (`pmax` of the log-sum-exps, `psum_scatter` of the rescaled outputs and
     weights), each device keeping its own slice's queries; then the output projection and the MLP.
One path serves every attention method and mesh: the methods' own code is not used (the chunk's attention reads
a cache, which theirs do not).

Sliding-window layers (`model.sliding_window`) write to and attend over a stack of their own beside the global
layers' (`jaxlong.generation.decode.stack_index`): each stack takes the chunk's keys where the layer is of its kind,
and the attention switches on the kind (`lax.switch`). A local layer's stack holds only the chunks its queries'
windows reach (`window_chunks`: the current chunk and the ceil((W - 1) / chunk) before it), in the same descending
order: each chunk shifts it by one slice and writes its own slice first, so it is the global layers' cache without
the chunks that have left every window. A window is a second bound per query: the slots before the first one
holding a prompt index at or below the query's less the window (`kv_ends`, which the blockwise and Pallas kernels
take), so the key tiles past every window of a query tile are not visited. After the chunk that holds a row's last
token, that row's last `window` positions are gathered from the stack into the decode step's window buffers
(`jaxlong.generation.decode.window_gather`): the local layers never hold more than a few chunks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.config import runtime
from jaxlong.core.mesh import BATCH_AXES, SEQ_AXES, axis_size, seq_shards
from jaxlong.generation.decode import Cache, by_kind, cache_shapes, output_head, stack_index, window_gather
from jaxlong.kernels.backend import attention_fwd_with_lse
from jaxlong.kernels.merge import NEG, merge_across
from jaxlong.kernels.layout import pallas_head_dim_ok
from jaxlong.models import llama as model_lib
from jaxlong.models.family import GLOBAL, LOCAL

__all__ = ["chunk_order", "chunk_slot", "chunk_tiles", "chunk_kv_steps", "chunk_kernel", "window_chunks",
           "ChunkedPrefill"]


def chunk_order(n: int, chunk: int, devices: int) -> np.ndarray:
    """`order[slot]`: the prompt index held at each slot of a chunk-prefilled cache of `n` tokens (`[n]` int64,
    the global prompt axis, sharded in `devices` equal parts).

    Device d's slot s, with `r = n / D - 1 - s`, holds prompt index `(r // (c / D)) c + d c / D + r % (c / D)`:
    its slice of every chunk, in descending order.

    Raises:
      ValueError: `n` not a multiple of `chunk`, or `chunk` not of `devices`."""
    if chunk <= 0 or n % chunk or chunk % devices:
        raise ValueError(f"a prompt of {n} tokens in chunks of {chunk} over {devices} sequence shards: the prompt "
                         f"must be a multiple of the chunk, the chunk of the shards")
    cl, local = chunk // devices, n // devices
    d, slot = np.meshgrid(np.arange(devices), np.arange(local), indexing="ij")
    r = local - 1 - slot
    return ((r // cl) * chunk + d * cl + r % cl).ravel()


def chunk_tiles(cfg, chunk: int, devices: int) -> tuple[int, int]:
    """(key tile, query tile) of the blockwise kernel over a shard's cache: `attention.block_k` over each shard's
    slice of a chunk (`chunk / devices` tokens) and `attention.block_q` over the chunk's queries, each the whole
    slice or chunk where that is shorter (`jaxlong.config.validate` requires one or the other)."""
    cl, a = chunk // devices, cfg.attention
    return (a.block_k if cl % a.block_k == 0 else cl), (a.block_q if chunk % a.block_q == 0 else chunk)


def chunk_kv_steps(cfg, chunk: int, devices: int, n: int) -> int:
    """Iterations of the blockwise kernel's key loop per device and layer in the last (longest) chunk of a prompt of
    `n` tokens, at most: the chunk's query tiles times the key tiles of the shard (the host-memory estimate,
    `jaxlong.evaluation.hostmem`)."""
    kb, qb = chunk_tiles(cfg, chunk, devices)
    return (chunk // qb) * (n // devices // kb)


def chunk_kernel(cfg, mesh) -> str:
    """The chunk attention kernel: `pallas` (the Pallas GPU kernel) on GPUs where it takes the head dim and dtype,
    `blockwise` (`jaxlong.kernels.blockwise`, pure JAX) elsewhere; both take a window's per-query key ends."""
    gpu = mesh.devices.flat[0].platform == "gpu"
    ok = pallas_head_dim_ok(cfg.model.head_dim) and cfg.compute_dtype in ("bfloat16", "float16", "float32")
    return "pallas" if gpu and ok else "blockwise"


def window_chunks(window: int, chunk: int, n: int) -> int:
    """Chunks a sliding-window layer's stack holds while a prompt of `n` tokens is prefilled in chunks of `chunk`:
    the current chunk and the `ceil((window - 1) / chunk)` before it, where its queries' windows (the query and the
    `window - 1` positions before it) reach; at most the prompt's `n / chunk`."""
    return min(n // chunk, 1 + -(-(window - 1) // chunk))


def _cache_ops(cfg, mesh, n: int, chunk: int, kernel: str, window: int):
    """The chunk step's two sharded operations on layer i of a stack of the cache whose layers see `window`
    positions (0: all before them): `write(kc, vc, k, v, i, j, on)` puts the slice's keys and values (`[b, kv_heads,
    chunk, head_dim]`, sequence over ring x context) of chunk j into the cache, and `attend(q, kc, vc, i, j)` attends
    the chunk's queries `[b, chunk, heads, head_dim]` (same sharding) to it, merged exactly over the shards
    (`jaxlong.kernels.merge.merge_across`). `kernel`: `chunk_kernel`'s or `pallas-interpret`.

    A global stack holds the whole prompt, chunk j's slice at slots `[local_n - (j + 1) cl, local_n - j cl)` of a
    shard; a window stack the last `window_chunks` slices, chunk j's first: the global layout less its first
    `base(j) = local_n - (j + 1) cl` slots."""
    seq = tuple(a for a in SEQ_AXES if axis_size(mesh, a) > 1)
    devices = seq_shards(mesh)
    cl, local_n = chunk // devices, n // devices
    held_n = window_chunks(window, chunk, n) * cl if window else local_n  # the stack's slots per shard
    kb, qb = chunk_tiles(cfg, chunk, devices)
    backend = "blockwise" if kernel == "blockwise" else "pallas"
    tiles = dict(block_q=qb, block_k=kb) if backend == "blockwise" else dict(interpret=kernel == "pallas-interpret")

    def base(j):  # the slots of the global layout before this stack's first
        return local_n - (j + 1) * cl if window else 0

    def write(kc, vc, k, v, i, j, on):
        """Local: the slice's k, v `[b, kv, cl, d]` (ascending) into layer i of the shard, descending, at chunk j's
        slots (a window stack shifted by one slice first, its oldest slice dropped); where `on` is False the layer
        keeps what it holds (a layer of the other kind: the write stays out of the `lax.switch`, so the stacks are
        updated in place)."""
        if window:
            def put(c, a):
                layer = jax.lax.dynamic_slice_in_dim(c, i, 1, axis=0)
                new = jnp.concatenate([a[None, :, :, ::-1].astype(c.dtype), layer[:, :, :, :held_n - cl]], axis=3)
                return jax.lax.dynamic_update_slice_in_dim(c, jnp.where(on, new, layer), i, axis=0)
        else:
            def put(c, a):
                at = (i, 0, 0, local_n - (j + 1) * cl, 0)
                now = jax.lax.dynamic_slice(c, at, (1, *a.shape[:2], cl, a.shape[3]))
                return jax.lax.dynamic_update_slice(c, jnp.where(on, a[None, :, :, ::-1], now), at)

        return put(kc, k), put(vc, v)

    def attend(q, kc, vc, i, j):
        """Local: q `[b, cl, h, d]` of this device's slice -> its attention output, same shape (float32)."""
        dev = jax.lax.axis_index(seq) if seq else 0  # the device's index along the flattened sequence axes
        if seq:
            q = jax.lax.all_gather(q, seq, axis=1, tiled=True)  # [b, chunk, h, d]: the whole chunk

        def after(index):  # the stack's slots holding prompt indices > index, its first ones (`chunk_order`)
            held = (index // chunk) * cl + jnp.clip(index % chunk - dev * cl + 1, 0, cl)  # indices <= index
            return jnp.clip(local_n - base(j) - jnp.where(index >= 0, held, 0), 0, held_n)

        # Each query sees the shard's keys of prompt index <= its own, the slots from `after(index)` on (the earlier
        # chunks' slices, and of chunk j's slice those up to the query), and in a window only those above its
        # floor, the slots before `after(index - window)`.
        index = jnp.broadcast_to(j * chunk + jnp.arange(chunk), q.shape[:2])
        o, lse = attention_fwd_with_lse(q, kc[i], vc[i], backend=backend, causal=False, kv_starts=after(index),
                                        kv_ends=after(index - window) if window else None, kv_head_major=True,
                                        **tiles)
        lse = jnp.swapaxes(lse, 1, 2)  # [b, chunk, h]; -inf where a query sees none of these keys
        o, lse = o.astype(jnp.float32), jnp.where(jnp.isfinite(lse), lse, NEG)
        # exact merge over the shards, each device keeping its own slice's queries; a query that sees no key: 0
        return merge_across(o, lse, seq, scatter_axis=1)[0] if seq else o

    cache_spec, kv_spec = P(None, BATCH_AXES, None, SEQ_AXES, None), P(BATCH_AXES, None, SEQ_AXES, None)
    q_spec = P(BATCH_AXES, SEQ_AXES, None, None)
    local = dict(mesh=mesh, check_vma=False)
    return (jax.shard_map(write, in_specs=(cache_spec, cache_spec, kv_spec, kv_spec, P(), P(), P()),
                          out_specs=(cache_spec, cache_spec), **local),
            jax.shard_map(attend, in_specs=(q_spec, cache_spec, cache_spec, P(), P()), out_specs=q_spec, **local))


def _make_chunk_step(cfg, mesh, n: int, chunk: int, kernel: str):
    """The jitted step of one chunk: `(params, cache, batch, j, last, logits) -> (logits, cache)`.

    `cache` `(k, v, local_k, local_v)` (donated, returned with chunk `j` written): the global layers' keys and
    values `[global_layers, b, kv_heads, n, head_dim]` and the sliding-window layers' `[local_layers, b, kv_heads,
    window_chunks * chunk, head_dim]` (`ChunkedPrefill.stacks`), each
    layer writing to and attending over its kind's stack (`jaxlong.generation.decode.stack_index`, a `lax.switch` on
    the layer's kind in the one layer scan); `batch` the chunk's `inputs`, `positions`, `segment_ids` `[b, chunk]`
    int32 in prompt order; `last` `[b]` int32 each row's last real token (prompt index); `logits` `[b, vocab]`
    float32: each row's logits of that token, taken from this chunk where it holds it, else passed through.
    `kernel`: `chunk_kernel`'s, or `pallas-interpret` (the Pallas kernel in its interpreter: CPU tests). The layers
    are the model's own (`jaxlong.models.llama.Llama.cached_layers`)."""
    cd = jnp.dtype(cfg.compute_dtype)
    rt = runtime(cfg, mesh)
    graphdef = model_lib.model_graphdef(cfg.model, cfg.param_dtype)
    ops = {GLOBAL: _cache_ops(cfg, mesh, n, chunk, kernel, 0),
           LOCAL: _cache_ops(cfg, mesh, n, chunk, kernel, cfg.model.sliding_window)}
    kinds, index = stack_index(cfg.model)
    present = [kind for kind in (GLOBAL, LOCAL) if kind in kinds]
    kv_spec, q_spec = P(BATCH_AXES, None, SEQ_AXES, None), P(BATCH_AXES, SEQ_AXES, None, None)

    def step(params, cache, batch, j, last, logits):
        model = nnx.merge(graphdef, params)
        x = rt.constrain(model.embed_tokens(batch["inputs"], rt), P(BATCH_AXES, SEQ_AXES, None))
        keep = (batch["segment_ids"] > 0)[..., None, None]

        def attend(q, k, v, i, cache, _):
            """Layer i: the slice's k, v (padding zeroed) into its stack, then the chunk's attention over it."""
            k, v = (rt.constrain(jnp.swapaxes(jnp.where(keep, a, 0), 1, 2).astype(cd), kv_spec) for a in (k, v))
            q = rt.constrain(q.astype(cd), q_spec)
            cache, kind, s = list(cache), jnp.asarray(kinds)[i], jnp.asarray(index)[i]
            for here in present:  # each kind's stack takes the chunk where the layer is of its kind (else: as is)
                at, on = 2 * here, kind == here
                cache[at], cache[at + 1] = ops[here][0](cache[at], cache[at + 1], k, v, jnp.where(on, s, 0), j, on)

            def on(here):
                return ops[here][1](q, cache[2 * here], cache[2 * here + 1], s, j).astype(cd)

            return by_kind(kinds, i, on), tuple(cache)

        x, cache = model.cached_layers(x, batch["positions"], rt, attend, tuple(cache),
                                       spec=P(BATCH_AXES, SEQ_AXES, None))
        at = last - j * chunk  # each row's last token in this chunk, if it is
        here = (at >= 0) & (at < chunk)
        h = jnp.take_along_axis(x, jnp.clip(at, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        h = rt.constrain(model.final(h), P(BATCH_AXES, None))
        new = jnp.einsum("bh,hv->bv", h, rt.gather(output_head(params, cfg))).astype(jnp.float32)
        return jnp.where(here[:, None], new, logits), cache

    cache = NamedSharding(mesh, P(None, BATCH_AXES, None, SEQ_AXES, None))
    rows = NamedSharding(mesh, P(BATCH_AXES, None))
    return jax.jit(step, donate_argnums=(1, 5), out_shardings=(rows, (cache,) * 4))


def chunk_slot(index: jax.Array, n: int, chunk: int, devices: int) -> jax.Array:
    """The slot of a chunk-prefilled cache (`chunk_order`) that holds prompt index `index` (int32, any shape): the
    inverse of the order, computed (no table)."""
    cl, local = chunk // devices, n // devices
    within = index % chunk
    r = (index // chunk) * cl + within % cl
    return (within // cl) * local + local - 1 - r


class ChunkedPrefill:
    """`prefill(params, host_batch) -> (logits [b, vocab] float32, Cache)`, as `make_prefill`'s, for a host batch
    (`inputs`, `positions`, `segment_ids` `[b, n]` int32 numpy, *right*-padded, in prompt order) whose length `n`
    is a multiple of `chunk`: the cache is allocated once and filled by `n / chunk` calls of one compiled chunk step
    (one compile per batch shape), each donating it. The cache's prompt axis is in `chunk_order`. `chunk` is
    `prefill_chunk`, which `jaxlong.config.validate` checks against the mesh and the attention tiles.
    `on_chunk(done, chunks)`, when given, is called as each chunk's program has run (progress: a 1M-token prompt
    in chunks of 8K is 128 programs, hours on a CPU host).
    """

    def __init__(self, cfg, mesh, chunk: int, max_new: int, kernel: str | None = None):
        self.devices = seq_shards(mesh)
        self.cfg, self.mesh, self.chunk, self.max_new = cfg, mesh, chunk, max_new
        self.kernel = kernel or chunk_kernel(cfg, mesh)
        self.steps: dict = {}

    def step_for(self, n: int):
        """The chunk step for prompts of `n` tokens (`jax.jit`, one per `n`)."""
        if n not in self.steps:
            self.steps[n] = _make_chunk_step(self.cfg, self.mesh, n, self.chunk, self.kernel)
        return self.steps[n]

    def abstract_args(self, rows: int, n: int) -> tuple:
        """The chunk step's arguments but `params`, as `jax.ShapeDtypeStruct`s (ahead-of-time compiles)."""
        m = self.cfg.model
        ids = jax.ShapeDtypeStruct((rows, self.chunk), jnp.int32, sharding=NamedSharding(self.mesh, P(BATCH_AXES,
                                                                                                     SEQ_AXES)))
        vec = jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=NamedSharding(self.mesh, P(BATCH_AXES)))
        logits = jax.ShapeDtypeStruct((rows, m.vocab_size), jnp.float32,
                                      sharding=NamedSharding(self.mesh, P(BATCH_AXES, None)))
        batch = {k: ids for k in ("inputs", "positions", "segment_ids")}
        return self.stacks(rows, n), batch, jax.ShapeDtypeStruct((), jnp.int32), vec, logits

    def stacks(self, rows: int, n: int) -> tuple:
        """The chunk step's cache `(k, v, local_k, local_v)` as `jax.ShapeDtypeStruct`s: the global layers' whole-
        prompt stacks and the sliding-window layers' stacks of `window_chunks` chunks (the chunks their queries'
        windows reach)."""
        full = cache_shapes(self.cfg, self.mesh, rows, n, self.max_new)
        kinds, _ = stack_index(self.cfg.model)
        m = self.cfg.model
        held = window_chunks(m.sliding_window, self.chunk, n) * self.chunk if m.sliding_window else n
        local = jax.ShapeDtypeStruct((int((kinds == LOCAL).sum()), *full.k.shape[1:3], held, full.k.shape[4]),
                                     full.k.dtype, sharding=full.k.sharding)
        return full.k, full.v, local, local

    def __call__(self, params, host: dict, on_chunk: Callable[[int, int], None] | None = None):
        rows, n = host["inputs"].shape
        order = chunk_order(n, self.chunk, self.devices)
        put = _putter(self.mesh, P(BATCH_AXES, SEQ_AXES))
        valid = put(host["segment_ids"][:, order] > 0)
        ends = (host["segment_ids"] > 0).sum(axis=1).astype(np.int32) - 1  # each row's last token (-1: none)
        last = _putter(self.mesh, P(BATCH_AXES))(ends)
        cache = tuple(zeros(a.shape, a.dtype, a.sharding) for a in self.stacks(rows, n))
        logits = zeros((rows, self.cfg.model.vocab_size), jnp.float32, NamedSharding(self.mesh, P(BATCH_AXES, None)))
        empty = cache_shapes(self.cfg, self.mesh, rows, n, self.max_new)
        win = tuple(zeros(a.shape, a.dtype, a.sharding) for a in (empty.win_k, empty.win_v))
        window = self.cfg.model.sliding_window
        keep = _keep_window(self.mesh, window, self.chunk, self.devices, window_chunks(window, self.chunk, n)) \
            if win[0].shape[0] else None  # the window buffers of the rows that end in a chunk
        step = self.step_for(n)
        for j in range(n // self.chunk):
            part = {k: put(np.ascontiguousarray(host[k][:, j * self.chunk:(j + 1) * self.chunk]))
                    for k in ("inputs", "positions", "segment_ids")}
            logits, cache = step(params, cache, part, np.int32(j), last, logits)
            if keep is not None and (ends // self.chunk == j).any():  # rows ending here: keep their window
                win = keep(*win, *cache[2:], last, np.int32(j))
            if on_chunk is not None:
                logits.block_until_ready()  # the chunk has run, not only been dispatched
                on_chunk(j + 1, n // self.chunk)
        k, v, _, _ = cache
        del cache  # the window layers' stacks, freed here
        new_k, new_v = (zeros(a.shape, a.dtype, a.sharding) for a in (empty.new_k, empty.new_v))  # two buffers
        return logits, Cache(k, v, valid, new_k, new_v, *win)


@functools.lru_cache(maxsize=8)
def _keep_window(mesh, window: int, chunk: int, devices: int, held: int):
    """`keep(win_k, win_v, local_k, local_v, last, j) -> (win_k, win_v)`, jitted: for the rows whose last token
    (`last` `[b]`) is in chunk j, their last `window` positions (`jaxlong.generation.decode.window_gather`) from the
    window layers' stacks as chunk j left them (`held` chunks, j's first: the chunk-prefilled cache of chunks
    `j + 1 - held` to j, so a row's index less `(j + 1 - held) chunk` is its index there); the other rows' as
    given."""
    gather = window_gather(mesh, window, lambda i: chunk_slot(i, held * chunk, chunk, devices))

    def keep(win_k, win_v, local_k, local_v, last, j):
        wk, wv = gather(local_k, local_v, last - (j + 1 - held) * chunk)
        here = (last // chunk == j)[None, :, None, None, None]
        before = (last[:, None] - window + 1 + jnp.arange(window) < 0)[None, :, None, :, None]  # zero, never read
        return tuple(jnp.where(here, jnp.where(before, 0, new), old) for new, old in ((wk, win_k), (wv, win_v)))

    return jax.jit(keep, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=32)
def _zeros_fn(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zeros(shape: tuple, dtype, sharding) -> jax.Array:
    """A zero array made on the devices with `sharding` (never on the host), one compile per shape."""
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


def _putter(mesh, spec):
    """Place a host array (the same on every process) sharded by `spec`, in the order given (no zigzag)."""
    sharding = NamedSharding(mesh, spec)

    def put(a: np.ndarray):
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    return put

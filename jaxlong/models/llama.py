"""The decoder-only model of every family in Flax NNX: token embedding, a scan over stacked decoder layers, final
RMSNorm, output head. Llama-3 is written out below; a family (`jaxlong.models.family`: Gemma 3) names the parts its
layer adds (the norm's `1 + w`, post-attention and post-MLP norms, GeGLU, the embedding scale, the query scale,
sliding-window layers), and the one `DecoderLayer` serves training, the prefill, the chunked prefill and decoding.

Each decoder layer (Llama-3, Grattafiori et al. 2024, §3; Touvron et al. 2023, §2.2) is
`x += W_o attention(RoPE(W_q n(x)), RoPE(W_k n(x)), W_v n(x))` then `x += SwiGLU(n(x))`, with RMSNorm `n`
and grouped-query attention. Weight layouts keep heads explicit so head-chunked attention (U-Pipe) can take
row blocks: W_q `[hidden, heads, head_dim]`, W_k/W_v `[hidden, kv_heads, head_dim]`, W_o
`[heads, head_dim, hidden]`. Qwen3 (`model.qk_norm`) adds an RMSNorm over head_dim on every query and key head
before RoPE (scales `q_norm`, `k_norm` `[head_dim]`); RoPE frequencies may be rescaled (`model.rope_scaling`:
linear, llama3, yarn; `jaxlong.layers.blocks.rope_frequencies`). Hugging Face checkpoints map onto these parameters in
`jaxlong.models.hf`.

The decoder layers' parameters are stacked on a leading `[layers]` axis and run by one `lax.scan`, so compile
time does not grow with depth; layers of different kinds (global, or local with a window) switch on their kind
inside it (`lax.switch` between the kinds' attention records, `Runtime.attention_context`), or, where they offload
from inside attention, take it as a constant in a scan over the kinds' period (`jaxlong.layers.remat.scan_layers`).
Inside the scan body each layer's FSDP-sharded weights are cast to the compute dtype and gathered (a replicated
sharding constraint), so only one layer's full weights are live at a time; the transpose of that gather
reduce-scatters the gradients.

Packed documents (`positions`, `segment_ids` `[batch, seq]` from the batch): RoPE rotates by each token's
position within its document, and attention masks across documents. The segment ids are gathered whole onto
every context device once, before the layer scan (`jaxlong.parallel.ulysses.gather_segment_ids`), and every layer
reuses them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlong.core.mesh import BATCH_AXES, RING_AXIS, SEQ_AXES, activation_spec, axis_size, batch_spec, seq_shards, tree_shardings
from jaxlong.core.ordering import grads_together
from jaxlong.kernels.backend import resolve_backend
from jaxlong.layers import blocks as L
from jaxlong.layers import remat as R
from jaxlong.layers.blocks import RopeScalingConfig
from jaxlong.layers.projection import project_qkv
from jaxlong.layers.remat import RematConfig
from jaxlong.layers.tiled import TilingConfig, default_mlp_tiles, tiled_mlp
from jaxlong.models.config import ModelConfig
from jaxlong.models.family import GLOBAL, LOCAL, embed_scale, family_of, layer_kinds, query_scale
from jaxlong.parallel.dispatch import AttentionConfig, SublayerContext, SublayerWeights, attention_sublayer
from jaxlong.parallel.ring import zigzag_positions
from jaxlong.parallel.ulysses import gather_segment_ids


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What the forward pass reads besides the parameters: static (not traced), built once per program from the
    config sections it needs (`jaxlong.config.runtime`), never the run's whole config.

    Attributes:
      mesh: the `data x fsdp x ring x context` mesh.
      model: the model section (`model.*`).
      attention: the attention section (`attention.*`: method, kernel, tiles, U-Pipe's heads per stage).
      remat: the remat section (`remat.*`: policy, grouped offload, kept attention).
      tiling: the tiling section (`tiling.*`: tiled loss and MLP).
      compute_dtype: matmuls and activations (`compute_dtype`), a numpy dtype.
      document_masking: attention masks by the batches' segment ids (`data.packing=documents`); False: each row is
        one causal stream (`concat`).
      keep_attention: the layer keeps its attention output and lse (`remat.keep_attention`).
    """

    mesh: jax.sharding.Mesh
    model: ModelConfig
    attention: AttentionConfig
    remat: RematConfig
    tiling: TilingConfig
    compute_dtype: Any = jnp.float32
    document_masking: bool = True
    keep_attention: bool = False

    def __post_init__(self):
        object.__setattr__(self, "compute_dtype", jnp.dtype(self.compute_dtype))

    @property
    def attention_backend(self) -> str:
        """`attention.backend` with `auto` resolved for the mesh's devices (GPU compile-only devices included) and
        the batches (document masking carries segment ids, which cuDNN cannot mask: the Pallas kernel on GPUs, the
        blockwise one elsewhere). With `mesh.ring` > 1 it runs ring attention's blocks
        (`jaxlong.parallel.ring.ring_kernel`)."""
        probe = jax.ShapeDtypeStruct((self.model.head_dim,), self.compute_dtype)
        return resolve_backend(self.attention.backend, probe, segment_ids=True if self.document_masking else None,
                               platform=self.mesh.devices.flat[0].platform)

    @property
    def kinds(self) -> tuple[int, ...]:
        """Each layer's kind (`jaxlong.models.family.GLOBAL` or `LOCAL`), `[layers]`."""
        return layer_kinds(self.model)

    @property
    def mixed(self) -> bool:
        """The layers are of more than one kind: the layer scan switches on each layer's (one compiled program)."""
        return len(set(self.kinds)) > 1

    def attention_context(self, kind: int) -> SublayerContext:
        """The attention sublayer's typed record for layers of `kind`: what the parallel ops and kernels read (the
        method, kernel and tiles; a local layer's window and RoPE base, a global layer's RoPE base and scaling;
        the query scale)."""
        m, a = self.model, self.attention
        local = kind == LOCAL
        return SublayerContext(
            mesh=self.mesh, impl=a.impl, backend=self.attention_backend, block_q=a.block_q, block_k=a.block_k,
            heads_per_stage=a.heads_per_stage, head_dim=m.head_dim,
            rope_theta=m.rope_local_theta if local else m.rope_theta,
            rope_scaling=RopeScalingConfig() if local else m.rope_scaling, norm_eps=m.norm_eps,
            compute_dtype=self.compute_dtype, recompute_projection=self.remat.policy in ("full", "offload"),
            offload_attention_output=R.offloads_attention_output(self.remat, self.keep_attention),
            window=m.sliding_window if local else 0, query_scale=query_scale(m), window_exchange=a.window_exchange)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """RoPE tables `(cos, sin)` of integer `positions` `[b, s]` for each kind of layer, stacked on a leading
        axis indexed by the kind (`[2, b, s, head_dim / 2]` for a model with both kinds, else `[1, ...]`: index 0)."""
        kinds = (GLOBAL, LOCAL) if self.mixed else (self.kinds[0],)
        tables = [L.rope_tables(positions, self.model.head_dim, c.rope_theta, c.rope_scaling)
                  for c in map(self.attention_context, kinds)]
        return jnp.stack([t[0] for t in tables]), jnp.stack([t[1] for t in tables])

    def constrain(self, x: jax.Array, spec: P) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def gather(self, w: jax.Array) -> jax.Array:
        """FSDP all-gather of one layer's weight in the compute dtype (cast first: half the bytes moved)."""
        return self.constrain(w.astype(self.compute_dtype), P())


def _normal(std: float):
    return nnx.initializers.normal(stddev=std)


class DecoderLayer(nnx.Module):
    """One decoder layer of the model's family (`jaxlong.models.family`). Called on `[batch, seq, hidden]` with
    global positions `[batch, seq]`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        h, n, kv, d, f = cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp_hidden
        fam = family_of(cfg)
        init = _normal(cfg.init_std)
        out_init = _normal(cfg.init_std / (2 * cfg.layers) ** 0.5)
        self.norm_offset, self.activation, self.eps = fam.norm_offset, fam.activation, cfg.norm_eps
        norm = functools.partial(jnp.zeros if fam.norm_offset else jnp.ones, dtype=param_dtype)  # scale 1 at init
        self.attn_norm = nnx.Param(norm((h,)))
        self.wq = nnx.Param(init(rngs.params(), (h, n, d), param_dtype))
        self.wk = nnx.Param(init(rngs.params(), (h, kv, d), param_dtype))
        self.wv = nnx.Param(init(rngs.params(), (h, kv, d), param_dtype))
        self.wo = nnx.Param(out_init(rngs.params(), (n, d, h), param_dtype))
        self.mlp_norm = nnx.Param(norm((h,)))
        self.w_gate = nnx.Param(init(rngs.params(), (h, f), param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (h, f), param_dtype))
        self.w_down = nnx.Param(out_init(rngs.params(), (f, h), param_dtype))
        if cfg.qk_norm or fam.qk_norm:  # RMSNorm over head_dim of every query and key head, before RoPE
            self.q_norm = nnx.Param(norm((d,)))
            self.k_norm = nnx.Param(norm((d,)))
        if fam.sandwich_norms:  # Gemma 3: norms after the attention and the MLP, inside the residual
            self.post_attn_norm = nnx.Param(norm((h,)))
            self.post_mlp_norm = nnx.Param(norm((h,)))

    def _scale(self, name: str) -> jax.Array | None:
        """The scale a norm multiplies by: its weight, or `1 + w` in float32 (Gemma); None if the layer lacks it."""
        if not hasattr(self, name):
            return None
        w = getattr(self, name)[...]
        return w if not self.norm_offset else self.norm_offset + w.astype(jnp.float32)

    def weights(self) -> SublayerWeights:
        """The attention sublayer's weights as held (FSDP-sharded, `param_dtype`), the norms' scales as applied."""
        qk = (self._scale("q_norm"), self._scale("k_norm")) if hasattr(self, "q_norm") else None
        return SublayerWeights(self._scale("attn_norm"), self.wq[...], self.wk[...], self.wv[...], self.wo[...], qk,
                               self._scale("post_attn_norm"))

    def attention_block(self, x: jax.Array, positions: jax.Array, rt: Runtime,
                        segment_ids: jax.Array | None = None, kind: jax.Array | None = None) -> jax.Array:
        """The attention sublayer with its residual: `[b, s, hidden]` -> `x + W_o attention(RMSNorm(x))` (Gemma:
        the post-norm inside), by the method `attention.impl` names (`jaxlong.parallel.dispatch`). `kind`: the
        layer's kind where the model mixes kinds: a Python int picks its attention record, a traced int32 switches
        between them (`lax.switch`)."""
        w = self.weights()
        if kind is None or isinstance(kind, int):
            ctx = rt.attention_context(rt.kinds[0] if kind is None else kind)
            return attention_sublayer(x, w, positions, segment_ids, ctx)
        branches = [functools.partial(attention_sublayer, weights=w, positions=positions, segment_ids=segment_ids,
                                      ctx=rt.attention_context(k)) for k in (GLOBAL, LOCAL)]
        return jax.lax.switch(kind, branches, x)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array, rt: Runtime, queries: bool = True):
        """`(q, k, v)` of the layer input `x` `[b, s, hidden]` at RoPE tables `cos`, `sin` `[b, s, head_dim / 2]`
        (`jaxlong.layers.projection.project_qkv`, weights gathered in the compute dtype): q `[b, s, heads,
        head_dim]` (None unless `queries`), k, v `[b, s, kv_heads, head_dim]`."""
        w = self.weights()
        wq = rt.gather(w.wq) if queries else None
        return project_qkv(x, w.norm, wq, rt.gather(w.wk), rt.gather(w.wv), w.qk_norm, (cos, sin), self.eps,
                           q_scale=query_scale(rt.model))

    def mlp_block(self, x: jax.Array, rt: Runtime, tiled: bool) -> jax.Array:
        """The MLP sublayer with its residual, `[b, s, hidden]` -> `x + MLP(RMSNorm(x))` (Gemma: the post-norm
        inside); `tiled`: over sequence tiles (`jaxlong.layers.tiled.tiled_mlp`, ALST's tiled MLP, arXiv 2506.13996
        section 3.2)."""
        # The attention sublayer's backward waits for the MLP weights' reduced gradients: their unsharded
        # float32 sums are not held through it (`grads_together`).
        x, ws = grads_together(x, (self.w_gate[...], self.w_up[...], self.w_down[...]))
        ws = tuple(rt.gather(w) for w in ws)
        post = self._scale("post_mlp_norm")
        if tiled:  # the norms and the residual inside the tiles
            return tiled_mlp(x, *ws, tiles=mlp_tiles(x, rt), mesh=rt.mesh, norm_scale=self._scale("mlp_norm"),
                             norm_eps=self.eps, post_norm_scale=post, activation=self.activation)
        h = checkpoint_name(L.rms_norm(x, self._scale("mlp_norm"), self.eps), "mlp_norm_out")
        out = mlp(h, *ws, act=L.gate_activation(self.activation))
        return x + (out if post is None else L.rms_norm(out, post, self.eps))

    def __call__(self, x: jax.Array, positions: jax.Array, rt: Runtime,
                 segment_ids: jax.Array | None = None, kind: jax.Array | None = None) -> jax.Array:
        x = checkpoint_name(rt.constrain(x, activation_spec()), R.LAYER_INPUT)
        x = self.attention_block(x, positions, rt, segment_ids, kind)
        return rt.constrain(self.mlp_block(x, rt, rt.tiling.mlp), activation_spec())

    def cached(self, x: jax.Array, cos: jax.Array, sin: jax.Array, rt: Runtime, attend) -> jax.Array:
        """The layer with attention over a KV cache (prefill in chunks, decode): `x` `[b, s, hidden]` ->
        `x + W_o attend(q, k, v)` (Gemma: post-normed), then the MLP sublayer (untiled). `attend(q, k, v)` writes
        the new keys and values into the cache and returns the attention output `[b, s, heads, head_dim]`."""
        q, k, v = self.project(x, cos, sin, rt)
        out = jnp.einsum("bsnd,ndh->bsh", attend(q, k, v), rt.gather(self.wo[...]))
        post = self._scale("post_attn_norm")
        x = x + (out if post is None else L.rms_norm(out, post, self.eps))
        return self.mlp_block(x, rt, tiled=False)


def mlp_tiles(x: jax.Array, rt: Runtime) -> int:
    """Tiles per local sequence of the tiled MLP: `tiling.mlp_tiles`, or ALST's `ceil(S_local / hidden)`."""
    s_local = x.shape[1] // seq_shards(rt.mesh)
    return rt.tiling.mlp_tiles or default_mlp_tiles(s_local, x.shape[-1])


def mlp(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, act=jax.nn.silu) -> jax.Array:
    """The layer's gated MLP on the normalized `[b, s, hidden]`, `act(h W_gate) * (h W_up) W_down` (SwiGLU; GeGLU
    with the tanh GELU), untiled (`tiling.mlp` runs the whole sublayer in `jaxlong.layers.tiled.tiled_mlp`)."""
    gate = jnp.einsum("bsh,hf->bsf", h, w_gate)
    up = jnp.einsum("bsh,hf->bsf", h, w_up)
    act = checkpoint_name(act(gate) * up, "mlp_hidden")
    return jnp.einsum("bsf,fh->bsh", act, w_down)


class Llama(nnx.Module):
    """The decoder-only model of every family (`model.family`: Llama-3, Qwen3, SmolLM2; Gemma 3). `__call__(tokens [b, s] int32, rt)` -> final hidden states `[b, s, hidden]`.

    With `mesh.ring` > 1 the tokens (and the hidden states returned) are in ring attention's zigzag layout
    (`jaxlong.core.batch.zigzag_order`; `jaxlong.core.batch.put_batch` permutes the batch on the host) and RoPE uses
    their original positions.

    The output head is separate (`head_weight`) so the loss can be computed over sequence tiles without
    materializing `[b, s, vocab]` logits.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.tie_embeddings = cfg.tie_embeddings
        self.norm_eps = cfg.norm_eps
        self.norm_offset = family_of(cfg).norm_offset
        self.embed = nnx.Param(_normal(cfg.init_std)(rngs.params(), (cfg.vocab_size, cfg.hidden), param_dtype))

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return DecoderLayer(cfg, rngs=rngs, param_dtype=param_dtype)

        self.layers = make_layers(rngs)
        self.final_norm = nnx.Param((jnp.zeros if self.norm_offset else jnp.ones)((cfg.hidden,), param_dtype))
        if not cfg.tie_embeddings:
            self.lm_head = nnx.Param(_normal(cfg.init_std)(rngs.params(), (cfg.hidden, cfg.vocab_size), param_dtype))

    def head_weight(self, rt: Runtime, hidden: jax.Array | None = None):
        """Output projection `[hidden, vocab]` in the compute dtype (the embedding's transpose when tied).

        With the final `hidden` states `[b, s, hidden]`, returns `(hidden, head)` passed through
        `jaxlong.core.ordering.grads_together`: the layers' backward starts after the head's gradient is
        reduce-scattered, so its full-size copy is not held through it."""
        w = self.embed[...].T if self.tie_embeddings else self.lm_head[...]
        if hidden is None:
            return rt.gather(w)
        hidden, w = grads_together(hidden, w)
        return hidden, rt.gather(w)

    def embed_tokens(self, tokens: jax.Array, rt: Runtime, gather: bool = True) -> jax.Array:
        """Token embeddings `[b, s, hidden]` in the compute dtype (Gemma: times sqrt(hidden) rounded to it), from the
        table gathered whole (`gather`) or looked up where its shards lie (the decode step's sharded weights)."""
        table = rt.gather(self.embed[...]) if gather else self.embed[...].astype(rt.compute_dtype)
        x = jnp.take(table, tokens, axis=0)
        scale = embed_scale(rt.model, rt.compute_dtype)
        return x if scale is None else x * scale

    def final(self, x: jax.Array) -> jax.Array:
        """The final RMSNorm of the hidden states `[..., hidden]` (Gemma: `1 + w`)."""
        w = self.final_norm[...]
        return L.rms_norm(x, w if not self.norm_offset else self.norm_offset + w.astype(jnp.float32), self.norm_eps)

    def _inputs(self, tokens: jax.Array, rt: Runtime, positions: jax.Array | None,
                segment_ids: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(embedded tokens `[b, s, hidden]`, positions `[b, s]`, segment ids gathered for every layer)."""
        b, s = tokens.shape
        x = rt.constrain(self.embed_tokens(tokens, rt), activation_spec())
        if positions is None:  # the global index (in ring attention's zigzag layout when ring > 1)
            pos = zigzag_positions(jnp.arange(s, dtype=jnp.int32), s, axis_size(rt.mesh, RING_AXIS))
            positions = jnp.broadcast_to(pos, (b, s))
        positions = rt.constrain(positions.astype(jnp.int32), batch_spec())
        if segment_ids is not None:  # whole sequences on every context device, once for all layers
            segment_ids = gather_segment_ids(segment_ids, rt.mesh)
        return x, positions, segment_ids

    def _stack(self, rt: Runtime):
        """(the layers' graph, the scanned inputs: their stacked state, with each layer's kind `[layers]` int32 where
        the model mixes kinds)."""
        layer_def, layer_state = nnx.split(self.layers)
        return layer_def, ((layer_state, jnp.asarray(rt.kinds, jnp.int32)) if rt.mixed else (layer_state, None))

    def prefill(self, tokens: jax.Array, rt: Runtime, positions: jax.Array, segment_ids: jax.Array, store=None,
                carry=None) -> tuple:
        """The forward of `__call__` (no remat: nothing is differentiated) that also returns every layer's post-RoPE
        keys and values, computed from the layer's input where the layer holds it, sharded by sequence over
        ring x context (zigzag layout when ring > 1): `(hidden [b, s, hidden], k, v [layers, b, kv_heads, s,
        head_dim])`, head-major (a decode step reads each head's keys contiguously, with no transpose of the
        cache), the K/V of padding (segment id 0) zero. The cache of `jaxlong.generation`.

        `store(k, v, i, carry) -> carry`, when given, takes layer i's (traced int32) `k`, `v` `[b, kv_heads, s,
        head_dim]` instead, into a cache it carries from `carry` (a pytree; a sliding-window layer may keep only its
        window), and the result is `(hidden, carry)`."""
        x, positions, ids = self._inputs(tokens, rt, positions, segment_ids)
        keep = rt.constrain(segment_ids > 0, batch_spec())[..., None, None]
        cos, sin = rt.rope(positions)
        layer_def, (layer_state, kinds) = self._stack(rt)

        def body(c, xs):
            x, acc = c
            state, kind, i = xs
            layer = nnx.merge(layer_def, state)
            at = 0 if kind is None else kind
            _, k, v = layer.project(x, cos[at], sin[at], rt, queries=False)
            spec = P(BATCH_AXES, None, SEQ_AXES, None)
            k, v = (rt.constrain(jnp.swapaxes(jnp.where(keep, a, 0), 1, 2), spec) for a in (k, v))
            x = layer(x, positions, rt, ids, kind)
            return ((x, acc), (k, v)) if store is None else ((x, store(k, v, i, acc)), None)

        n = jax.tree.leaves(layer_state)[0].shape[0]
        (x, acc), kv = jax.lax.scan(body, (x, carry), (layer_state, kinds, jnp.arange(n)))
        return (self.final(x), *kv) if store is None else (self.final(x), acc)

    def cached_layers(self, x: jax.Array, positions: jax.Array, rt: Runtime, attend, carry, xs=None,
                      spec: P | None = None):
        """Every decoder layer (`DecoderLayer.cached`) over `x` `[b, s, hidden]` at integer `positions` `[b, s]`
        with attention over a KV cache, in one `lax.scan` over the stacked layers: the chunked prefill and the
        decode step.

        `attend(q, k, v, i, carry, xs_i) -> (attention [b, s, heads, head_dim], carry)` for layer `i` (traced
        int32; its kind is `rt.kinds[i]`) writes the new keys and values into the cache it carries (`carry`, any
        pytree) and attends over it; `xs` (a pytree with a leading `[layers]` axis, or None) is handed to it a layer
        at a time. `spec`: the sharding of x between layers. Returns `(x, carry)` after the last layer (before the
        final norm)."""
        layer_def, (layer_state, kinds) = self._stack(rt)
        cos, sin = rt.rope(positions)

        def body(c, inp):
            x, carry = c
            state, kind, i, xs_i = inp
            box = [carry]

            def attend_here(q, k, v):
                out, box[0] = attend(q, k, v, i, box[0], xs_i)
                return out

            at = 0 if kind is None else kind
            x = nnx.merge(layer_def, state).cached(x, cos[at], sin[at], rt, attend_here)
            return (x if spec is None else rt.constrain(x, spec), box[0]), None

        n = jax.tree.leaves(layer_state)[0].shape[0]
        (x, carry), _ = jax.lax.scan(body, (x, carry), (layer_state, kinds, jnp.arange(n), xs))
        return x, carry

    def __call__(self, tokens: jax.Array, rt: Runtime, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> jax.Array:
        """`positions` int32 `[b, s]` (RoPE; default the global index) and `segment_ids` int32 `[b, s]`
        (document masking, 0 = padding; default none) come from packed batches. Layers of different kinds (a
        sliding window or none) run in the one scan, each switching on its kind."""
        x, positions, segment_ids = self._inputs(tokens, rt, positions, segment_ids)
        layer_def, (layer_state, kinds) = self._stack(rt)

        def layer(rt):
            def body(carry, xs):
                state, kind = xs if rt.mixed else (xs, None)
                return nnx.merge(layer_def, state)(carry, positions, rt, segment_ids, kind), None
            return body

        cd = rt.compute_dtype
        x = R.scan_layers(layer(rt), x, layer_state if kinds is None else (layer_state, kinds), rt.remat,
                          group_params=lambda p: jax.tree.map(lambda a: a.astype(cd) if a.ndim > 2 else a, p),
                          keep_layer=layer(dataclasses.replace(rt, keep_attention=True)),
                          kinds=rt.kinds if rt.mixed else None, output_offload=rt.attention.impl == "upipe")
        return self.final(x)


# ----------------------------------------------------------------------------------------------
# Pure-function view used by the trainer: parameters are a plain dict of arrays.


def model_graphdef(model: ModelConfig, param_dtype: str = "float32"):
    """The NNX graph definition of the model (no parameters allocated)."""
    abstract = nnx.eval_shape(lambda: Llama(model, rngs=nnx.Rngs(0), param_dtype=jnp.dtype(param_dtype)))
    return nnx.graphdef(abstract)


def _pure_params(model: ModelConfig, rngs: nnx.Rngs, param_dtype: str) -> dict:
    return nnx.to_pure_dict(nnx.state(Llama(model, rngs=rngs, param_dtype=jnp.dtype(param_dtype)), nnx.Param))


def abstract_params(model: ModelConfig, param_dtype: str = "float32") -> dict:
    """`jax.ShapeDtypeStruct` tree of the parameters (nothing allocated), in `param_dtype`."""
    return jax.eval_shape(lambda: _pure_params(model, nnx.Rngs(0), param_dtype))


def init_params(model: ModelConfig, mesh: jax.sharding.Mesh, seed: int, param_dtype: str = "float32") -> dict:
    """Initialize parameters from `seed` directly into their FSDP shardings (no host copy of the full model).

    Returns a nested dict of `jax.Array` in `param_dtype`; stacked decoder weights have a leading `[layers]` axis.
    """
    shardings = tree_shardings(mesh, abstract_params(model, param_dtype))
    create = jax.jit(lambda key: _pure_params(model, nnx.Rngs(params=key), param_dtype), out_shardings=shardings)
    return create(jax.random.key(seed))


def forward(graphdef, params: dict, tokens: jax.Array, rt: Runtime, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`tokens [b, s]` -> (final hidden states `[b, s, hidden]`, output head `[hidden, vocab]`); `positions` and
    `segment_ids` `[b, s]` for packed documents (see `Llama.__call__`)."""
    model = nnx.merge(graphdef, params)
    return model.head_weight(rt, model(tokens, rt, positions, segment_ids))

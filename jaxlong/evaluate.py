"""Long-context evaluation: held-out loss on the training mesh, loss by token position, passkey retrieval.

Long-context users check three things (LongLoRA, Chen et al. 2023, §4; RULER, Hsieh et al. 2024): the held-out
loss at the training length, how the loss falls with token position (a model that uses its context keeps
improving deep into the window), and retrieval of a fact planted far back (passkey, Mohtashami & Jaggi 2023).

* `held_out_split` holds out whole documents of the packed token stream (chosen by a seeded permutation).
* `make_eval_step` is the forward half of the train step: the same mesh, Ulysses / U-Pipe context
  parallelism, remat and tiling (`jaxlong.step.loss_sum_fn`), returning a loss *sum* and valid-token count so
  batches combine exactly. It takes only the parameters (no optimizer state, no gradients), so it fits
  wherever the train step fits.
* `make_token_stats_step` returns per-token loss and argmax `[batch, seq]` for loss by position and passkey
  scoring. It always works over sequence tiles of each device's local sequence (`tiling.loss_tile`, or the
  256 MiB float32 logits budget of `jaxlong.tiled.default_loss_tile`): `[seq, vocab]` logits never exist on a
  device, whatever the length.
* Passkey retrieval is scored teacher-forced: the answer is part of the input, and an example counts as
  retrieved when the argmax at every answer position is the answer's token, so one forward per example.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlong import model as model_lib
from jaxlong import step as step_lib
from jaxlong.config import Config
from jaxlong.mesh import BATCH_AXES, CONTEXT_AXIS, batch_spec, replicated
from jaxlong.tiled import default_loss_tile, validate_loss_tile

# ----------------------------------------------------------------------------------------------
# Held-out data.


def held_out_split(tokens: np.ndarray, eod_id: int, fraction: float, seed: int,
                   min_tokens: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Split a packed token stream (documents each followed by `eod_id`) into train and held-out streams by
    whole documents, taken in the order of `np.random.default_rng([seed, 1]).permutation(n_docs)`: at least
    `max(1, round(fraction * n_docs))` documents, and more until they hold `min_tokens` tokens (enough for the
    validation batches), never all of them. Both streams keep their documents in corpus order. A trailing
    document without `eod_id` (a stream cut by `data.max_tokens`) counts as a document.

    Returns `(train_tokens, eval_tokens)`, int32 `[n]` each.

    Raises:
      ValueError: the stream has fewer than two documents (option `eval_fraction`, or `eval_every=0`).
    """
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == eod_id) + 1
    if ends.size == 0 or ends[-1] != tokens.size:
        ends = np.append(ends, tokens.size)
    starts = np.concatenate([[0], ends[:-1]])
    n_docs = ends.size
    if n_docs < 2:
        raise ValueError(
            f"eval_fraction={fraction}: the corpus has {n_docs} document(s); a held-out split needs at least 2 "
            f"(use a corpus of several documents, or eval_every=0 to train without validation)"
        )
    order = np.random.default_rng([seed, 1]).permutation(n_docs)
    enough = np.flatnonzero(np.cumsum((ends - starts)[order]) >= min_tokens)
    n_eval = max(1, round(fraction * n_docs), int(enough[0]) + 1 if enough.size else n_docs)
    held = np.zeros(n_docs, bool)
    held[order[:min(n_eval, n_docs - 1)]] = True

    def gather(sel):
        return np.concatenate([tokens[s:e] for s, e in zip(starts[sel], ends[sel])]).astype(np.int32)

    return gather(~held), gather(held)


def held_out_documents(source, tokenizer, fraction: float, seed: int, min_tokens: int = 0) -> tuple[list, np.ndarray]:
    """Hold out whole documents of a corpus (`jaxlong.data.DocumentSource` or any sequence of texts) for
    validation: taken in the order of `np.random.default_rng([seed, 1]).permutation(n_docs)`, at least
    `max(1, round(fraction * n_docs))` and more until their tokens reach `min_tokens`, never all of them.

    Only the held-out documents are tokenized. Returns `(indices, tokens)`: the held-out document indices
    (sorted; the training pipeline skips them) and their token stream in corpus order (each document
    `[BOS] ids [EOS]`, as `jaxlong.data.document_tokens` makes it).

    Raises:
      ValueError: the corpus has fewer than two documents (option `eval_fraction`, or `eval_every=0`).
    """
    from jaxlong.data import document_tokens  # noqa: PLC0415

    n_docs = len(source)
    if n_docs < 2:
        raise ValueError(
            f"eval_fraction={fraction}: the corpus has {n_docs} document(s); a held-out split needs at least 2 "
            f"(use a corpus of several documents, or eval_every=0 to train without validation)"
        )
    order = np.random.default_rng([seed, 1]).permutation(n_docs)
    want, held, total = max(1, round(fraction * n_docs)), {}, 0
    for i in order[: n_docs - 1]:
        if len(held) >= want and total >= min_tokens:
            break
        held[int(i)] = document_tokens(source[int(i)], tokenizer)
        total += held[int(i)].size
    indices = sorted(held)
    return indices, np.concatenate([held[i] for i in indices]).astype(np.int32)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, n_batches: int,
                 eod_id: int | None = None) -> list[dict]:
    """The first `n_batches` batches of consecutive `seq_len + 1` windows (stride `seq_len`) of the held-out
    stream, as host arrays `inputs`, `targets` (int32 `[batch_size, seq_len]`), `mask` (float32, ones),
    `positions` and `segment_ids` (int32). With `eod_id`, a window's documents are told apart as in packed
    training batches: the segment id grows after each `eod_id` and positions restart at each document (so
    with `data.packing=documents` no token attends across a document boundary; a target that starts a new
    document is masked); without it, one segment and positions `0..seq_len-1`. Always the same batches for
    the same stream.

    Raises:
      ValueError: the stream cannot fill the batches (names `eval_batches`, `eval_fraction`).
    """
    tokens = np.asarray(tokens)
    n_windows = max(0, (tokens.size - 1) // seq_len)
    need = n_batches * batch_size
    if n_windows < need:
        raise ValueError(
            f"eval_batches={n_batches}: the held-out documents hold {tokens.size} tokens, {n_windows} sequences of "
            f"seq_len={seq_len}, fewer than the {need} needed ({n_batches} x {batch_size}); raise eval_fraction or "
            f"data.max_tokens, or lower eval_batches"
        )
    offsets = np.arange(seq_len + 1)
    out = []
    for i in range(n_batches):
        w = tokens[(np.arange(batch_size) + i * batch_size)[:, None] * seq_len + offsets].astype(np.int32)
        inputs, targets = w[:, :-1], w[:, 1:]
        mask = np.ones((batch_size, seq_len), np.float32)
        if eod_id is None:
            seg = np.ones((batch_size, seq_len), np.int32)
        else:
            starts = np.concatenate([np.zeros((batch_size, 1), bool), inputs[:, :-1] == eod_id], axis=1)
            seg = (1 + np.cumsum(starts, axis=1)).astype(np.int32)
            mask[inputs == eod_id] = 0.0  # the next document's first token is not predicted from the last one
        pos = np.zeros((batch_size, seq_len), np.int32)
        for r in range(batch_size):  # position within each document of the window
            first = np.flatnonzero(np.diff(seg[r], prepend=0))
            pos[r] = np.arange(seq_len) - np.repeat(first, np.diff(np.append(first, seq_len)))
        out.append({"inputs": inputs, "targets": targets, "mask": mask, "positions": pos, "segment_ids": seg})
    return out


def eval_batch_size(cfg: Config) -> int:
    """Sequences per eval batch: one training micro-batch (`global_batch / grad_accum`), so evaluation holds
    no more activations than a training micro-step."""
    return cfg.global_batch // cfg.grad_accum


# ----------------------------------------------------------------------------------------------
# Eval step: held-out loss on the training mesh.


def _param_shardings(cfg: Config, mesh) -> dict:
    return jax.tree.map(lambda x: x.sharding, step_lib.abstract_state(cfg, mesh)["params"])


def make_eval_step(cfg: Config, mesh: jax.sharding.Mesh):
    """`eval_step(params, batch) -> (loss_sum, count)`: float32 scalars, the masked next-token cross-entropy
    sum (nats) and valid-token count of `batch` (`[batch, seq]` arrays, any extra keys passed to the loss
    untouched), by the train step's forward (`jaxlong.step.loss_sum_fn`). Jitted with the parameters' FSDP
    shardings and the batch's `P(('data', 'fsdp'), 'context')`; nothing is donated."""
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)

    def eval_step(params, batch):
        return step_lib.loss_sum_fn(params, batch, graphdef, rt)

    batch_sh = NamedSharding(mesh, batch_spec())  # every `[batch, seq]` entry alike, whatever the keys
    return jax.jit(eval_step, in_shardings=(_param_shardings(cfg, mesh), batch_sh),
                   out_shardings=(replicated(mesh), replicated(mesh)))


def compile_eval_step(cfg: Config, mesh: jax.sharding.Mesh):
    """Ahead-of-time compile of `make_eval_step` (nothing allocated); `memory_analysis()` gives its per-device
    bytes, to print next to the train step's."""
    params = step_lib.abstract_state(cfg, mesh)["params"]
    return make_eval_step(cfg, mesh).lower(params, step_lib.abstract_batch(cfg, mesh, eval_batch_size(cfg))).compile()


def evaluate_loss(eval_step, params: dict, batches, sharding) -> dict:
    """Mean held-out loss over `batches` (host dicts), combined by sums: `{'loss': nats/token, 'perplexity':
    exp(loss), 'tokens': valid tokens}`. `sharding`: the batch sharding (`NamedSharding(mesh, batch_spec())`)."""
    from jaxlong.data import put_on_mesh  # noqa: PLC0415 (data pipeline imported on use)

    total, count = 0.0, 0.0
    for batch in batches:
        s, c = eval_step(params, put_on_mesh(batch, sharding, process_local=False))
        total, count = total + float(s), count + float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": count}


# ----------------------------------------------------------------------------------------------
# Per-token loss and argmax over sequence tiles.


def tiled_token_stats(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, tile: int,
                      mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token next-token loss and argmax without materializing `[batch, seq, vocab]` logits.

    Args:
      hidden: final hidden states `[batch, seq, hidden]`; with `mesh`, laid out `P(('data', 'fsdp'), 'context')`.
      head: output projection `[hidden, vocab]`, replicated.
      targets: next-token ids `[batch, seq]` int32.
      tile: tokens per tile along the (local) sequence; must divide seq (mesh None) or seq / mesh.context.
      mesh: the `data x fsdp x context` mesh, or None to run on the arrays as given.

    Returns:
      `(loss, argmax)`: float32 `[batch, seq]` cross-entropy in nats and int32 `[batch, seq]` most likely
      next token, sharded like `targets`. Float32 logits exist for one `[batch, tile, vocab]` tile at a time.

    Raises:
      ValueError: `tile` does not divide the local sequence length (option `tiling.loss_tile`).
    """

    def local(h, w, t):
        b, s, d = h.shape
        validate_loss_tile(s, tile)
        n = s // tile

        def one(args):
            h_t, t_t = args
            logits = jnp.einsum("bth,hv->btv", h_t, w, preferred_element_type=jnp.float32)
            lse = jax.nn.logsumexp(logits, axis=-1)
            tgt = jnp.take_along_axis(logits, t_t[..., None], axis=-1)[..., 0]
            return lse - tgt, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        hs = jnp.moveaxis(h.reshape(b, n, tile, d), 1, 0)
        ts = jnp.moveaxis(t.reshape(b, n, tile), 1, 0)
        loss, arg = jax.lax.map(one, (hs, ts))
        return jnp.moveaxis(loss, 0, 1).reshape(b, s), jnp.moveaxis(arg, 0, 1).reshape(b, s)

    if mesh is None:
        return local(hidden, head, targets)
    tok = P(BATCH_AXES, CONTEXT_AXIS)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES, CONTEXT_AXIS, None), P(), tok),
                         out_specs=(tok, tok), check_vma=True)(hidden, head, targets)


def make_token_stats_step(cfg: Config, mesh: jax.sharding.Mesh):
    """`stats(params, batch) -> (loss [b, s] float32, argmax [b, s] int32)`: the train step's forward, then
    `tiled_token_stats` with `tiling.loss_tile` or `default_loss_tile` (always tiled). Jitted; the batch may
    have any `[b, s]` shape the mesh divides (one compile per shape)."""
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)
    tok = NamedSharding(mesh, P(BATCH_AXES, CONTEXT_AXIS))

    def stats(params, batch):
        segment_ids = batch.get("segment_ids") if cfg.data.packing == "documents" else None
        hidden, head = model_lib.forward(graphdef, params, batch["inputs"], rt, batch.get("positions"), segment_ids)
        b, s = batch["targets"].shape
        s_local = s // mesh.shape[CONTEXT_AXIS]
        b_local = max(b // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
        tile = cfg.tiling.loss_tile if cfg.tiling.loss_tile and s_local % cfg.tiling.loss_tile == 0 else \
            default_loss_tile(s_local, head.shape[-1], batch=b_local)
        return tiled_token_stats(hidden, head, batch["targets"], tile=tile, mesh=mesh)

    return jax.jit(stats, in_shardings=(_param_shardings(cfg, mesh), tok), out_shardings=(tok, tok))


# ----------------------------------------------------------------------------------------------
# Loss by position.


def position_buckets(seq_len: int) -> np.ndarray:
    """Log-spaced bucket edges over token positions `[0, seq_len)`: 0, 1, 2, 4, ..., seq_len (powers of two,
    the last edge `seq_len`). Bucket i is positions `[edges[i], edges[i + 1])`."""
    edges = [0] + [2**k for k in range(int(math.log2(max(seq_len, 1))) + 1) if 2**k < seq_len] + [seq_len]
    return np.array(sorted(set(edges)), np.int64)


class PositionLoss:
    """Accumulates per-token losses `[b, s]` (with mask) into log-spaced position buckets."""

    def __init__(self, seq_len: int):
        self.edges = position_buckets(seq_len)
        self.sums = np.zeros(self.edges.size - 1)
        self.counts = np.zeros(self.edges.size - 1)

    def add(self, loss: np.ndarray, mask: np.ndarray) -> None:
        loss, mask = np.asarray(loss, np.float64), np.asarray(mask, np.float64)
        for i, (a, b) in enumerate(zip(self.edges[:-1], self.edges[1:])):
            self.sums[i] += float(np.sum(loss[:, a:b] * mask[:, a:b]))
            self.counts[i] += float(np.sum(mask[:, a:b]))

    def rows(self) -> list[dict]:
        """One dict per bucket: `start`, `end` (exclusive), `tokens`, `loss` (mean nats/token, nan if empty)."""
        return [
            {"start": int(a), "end": int(b), "tokens": int(c), "loss": s / c if c else float("nan")}
            for a, b, s, c in zip(self.edges[:-1], self.edges[1:], self.sums, self.counts)
        ]


# ----------------------------------------------------------------------------------------------
# Passkey retrieval.

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is {key}"


@dataclass(frozen=True)
class PasskeyExample:
    """One passkey sequence: `tokens` int32 `[length + 1]` (inputs = tokens[:-1], targets = tokens[1:]), the
    `answer` token positions in the targets (the key's last `len(key)` targets), the `key` and the actual
    `depth` (needle start / filler length)."""

    tokens: np.ndarray
    answer: np.ndarray
    key: str
    depth: float


def passkey_example(encode: Callable[[str], np.ndarray], length: int, depth: float, key: str) -> PasskeyExample:
    """Filler text with a needle "The pass key is KEY. Remember it. KEY is the pass key." planted at `depth`
    (0 = start of the text, 1 = just before the question), ending with "What is the pass key? The pass key is
    KEY" so that the key's tokens are the last targets (Mohtashami & Jaggi 2023, the LongLoRA passkey test).

    Args:
      encode: tokenizer `str -> int [n]`.
      length: sequence length S (the example has S + 1 tokens).
      depth: needle depth in [0, 1].
      key: the passkey, e.g. "48213".

    Raises:
      ValueError: `length` cannot hold the needle and the question, or depth is outside [0, 1].
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth={depth} must be in [0, 1]")
    needle = np.asarray(encode(NEEDLE.format(key=key)), np.int32)
    question = np.asarray(encode(QUESTION.format(key=key)), np.int32)
    answer_len = len(np.asarray(encode(key)))
    n_filler = length + 1 - needle.size - question.size
    if n_filler < 0:
        raise ValueError(f"passkey length={length} is too short for the needle and question "
                         f"({needle.size + question.size - 1} tokens at least)")
    unit = np.asarray(encode(FILLER), np.int32)
    filler = np.tile(unit, n_filler // unit.size + 1)[:n_filler]
    at = int(round(depth * n_filler))
    tokens = np.concatenate([filler[:at], needle, filler[at:], question])
    answer = np.arange(length - answer_len, length)
    return PasskeyExample(tokens, answer, key, at / max(n_filler, 1))


def random_key(rng: np.random.Generator, digits: int) -> str:
    """A `digits`-digit decimal passkey with a nonzero first digit."""
    return str(rng.integers(1, 10)) + "".join(str(d) for d in rng.integers(0, 10, digits - 1))


def passkey_batch(examples: list[PasskeyExample]) -> dict:
    """Host batch `{'inputs', 'targets', 'mask', 'positions', 'segment_ids'}` `[len(examples), S]` of same-length
    passkey examples (one document per row); the mask covers the answer positions only."""
    tokens = np.stack([e.tokens for e in examples])
    mask = np.zeros(tokens[:, 1:].shape, np.float32)
    for i, e in enumerate(examples):
        mask[i, e.answer] = 1.0
    b, s = mask.shape
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask,
            "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
            "segment_ids": np.ones((b, s), np.int32)}  # one document per row


def score_passkey(predict: Callable[[dict], np.ndarray], encode: Callable[[str], np.ndarray], *,
                  lengths: list[int], depths: list[float], per_cell: int, batch_size: int, digits: int = 5,
                  seed: int = 0, progress: Callable[[int], None] | None = None) -> np.ndarray:
    """Teacher-forced passkey retrieval accuracy on a `depth x length` grid.

    Args:
      predict: `batch -> argmax [b, S]` (host numpy; e.g. the argmax of `make_token_stats_step`), called with
        `passkey_batch` batches of `batch_size` same-length examples.
      encode: tokenizer `str -> int [n]`.
      lengths, depths: the grid; per_cell: examples per cell (rounded up to a multiple of batch_size).
      digits: passkey length in digits; seed: fixes keys (and so the examples).
      progress: called with the number of examples after each forward.

    Returns:
      float `[len(depths), len(lengths)]`: the fraction of examples whose argmax equals the target at every
      answer position (all of the key's tokens right).
    """
    rng = np.random.default_rng([seed, 2])
    n_batches = -(-per_cell // batch_size)
    acc = np.zeros((len(depths), len(lengths)))
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            right = total = 0
            for _ in range(n_batches):
                examples = [passkey_example(encode, length, depth, random_key(rng, digits)) for _ in range(batch_size)]
                batch = passkey_batch(examples)
                argmax = np.asarray(predict(batch))
                for k, e in enumerate(examples):
                    right += bool(np.all(argmax[k, e.answer] == batch["targets"][k, e.answer]))
                total += len(examples)
                if progress:
                    progress(len(examples))
            acc[i, j] = right / total
    return acc


# ----------------------------------------------------------------------------------------------
# Validation during training.


class Validator:
    """Validation in the train loop: the held-out split, its fixed batches and the AOT-compiled eval step.

    `Validator(cfg, mesh, tokens, eod_id)` splits the packed corpus stream (`held_out_split`, documents fixed by
    `seed`; at least `eval_fraction` of them, more if their tokens cannot fill the validation batches), or with
    `held_out=True` takes `tokens` as the held-out stream (`held_out_documents`, what the trainer does), builds `eval_batches` batches of `eval_batch_size(cfg)` sequences (raising `ValueError` before any
    compile if the held-out documents are too few), and `compile()` compiles the eval step ahead of time.
    `train_tokens` is the stream left for training; `due(step)` says whether to validate after `step` (every
    `eval_every` steps and after the last); `run(params)` returns `{'loss', 'perplexity', 'tokens'}`.
    """

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh, tokens: np.ndarray, eod_id: int,
                 held_out: bool = False):
        self.cfg, self.mesh = cfg, mesh
        if held_out:  # `tokens` is the held-out stream already (`held_out_documents`)
            self.train_tokens, eval_tokens = None, tokens
        else:
            self.train_tokens, eval_tokens = held_out_split(tokens, eod_id, cfg.eval_fraction, cfg.seed,
                                                            self.tokens_needed(cfg))
        self.batches = eval_batches(eval_tokens, seq_len=cfg.seq_len, batch_size=eval_batch_size(cfg),
                                    n_batches=cfg.eval_batches, eod_id=eod_id)
        self.compiled = None

    @staticmethod
    def tokens_needed(cfg: Config) -> int:
        """Held-out tokens that fill the validation batches."""
        return cfg.eval_batches * eval_batch_size(cfg) * cfg.seq_len + 1

    def compile(self):
        """AOT-compile the eval step; returns the `jax.stages.Compiled` (for its `memory_analysis`)."""
        self.compiled = compile_eval_step(self.cfg, self.mesh)
        return self.compiled

    def due(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    def run(self, params: dict) -> dict:


        return evaluate_loss(self.compiled, params, self.batches, NamedSharding(self.mesh, batch_spec()))

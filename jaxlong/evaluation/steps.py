"""Long-context evaluation: held-out loss on the training mesh, loss by token position, passkey retrieval.

Long-context users check three things (LongLoRA, Chen et al. 2023, §4; RULER, Hsieh et al. 2024): the held-out
loss at the training length, how the loss falls with token position (a model that uses its context keeps
improving deep into the window), and retrieval of a fact planted far back (passkey, Mohtashami & Jaggi 2023).

* `validation_split` holds out whole documents (chosen by a seeded permutation) and packs them into batches
  with the training pipeline itself, so validation and training batches present documents alike.
* `make_eval_step` is the forward half of the train step: the same mesh, Ulysses / U-Pipe context
  parallelism, remat and tiling (`jaxlong.training.step.loss_sum_fn`), returning a loss *sum* and valid-token count so
  batches combine exactly. It takes only the parameters (no optimizer state, no gradients), so it fits
  wherever the train step fits.
* `make_token_stats_step` returns per-token loss and argmax `[batch, seq]` for loss by position and passkey
  scoring. It always works over sequence tiles of each device's local sequence (`tiling.loss_tile`, or the
  256 MiB float32 logits budget of `jaxlong.layers.tiled.default_loss_tile`): `[seq, vocab]` logits never exist on a
  device, whatever the length.
* Passkey retrieval is scored teacher-forced: the answer is part of the input, and an example counts as
  retrieved when the argmax at every answer position is the answer's token, so one forward per example.
* `evaluate_params` runs all three for given parameters on a mesh (what `python -m jaxlong.eval` reports).

Every batch goes onto the mesh through `jaxlong.training.step.put_batch`, the train step's input layout (the zigzag
order under ring attention), and per-token results come back through `jaxlong.training.step.natural_order`: the
results are those of one device on every mesh.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxlong.models import llama as model_lib
from jaxlong.training import step as step_lib
from jaxlong.config import Config
from jaxlong.core.mesh import BATCH_AXES, replicated, seq_axes, seq_shards
from jaxlong.layers.tiled import default_loss_tile, validate_loss_tile

# ----------------------------------------------------------------------------------------------
# Held-out data: whole documents, packed into batches by the training pipeline.


def held_out_documents(source, tokenizer, fraction: float, seed: int, min_tokens: int = 0) -> list[int]:
    """Hold out whole documents of a corpus (`jaxlong.data.DocumentSource` or any sequence of texts) for
    validation: taken in the order of `np.random.default_rng([seed, 1]).permutation(n_docs)`, at least
    `max(1, round(fraction * n_docs))` and more until their tokens (`[BOS] ids [EOS]` each) reach `min_tokens`,
    never all of them. Only the documents taken are tokenized.

    Returns the held-out document indices, sorted (the training pipeline skips them).

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
    want, held, total = max(1, round(fraction * n_docs)), [], 0
    for i in order[: n_docs - 1]:
        if len(held) >= want and total >= min_tokens:
            break
        held.append(int(i))
        total += document_tokens(source[int(i)], tokenizer).size
    return sorted(held)


def validation_batches(cfg: Config, source, tokenizer, indices, n_batches: int) -> list[dict]:
    """The validation batches of the documents at `indices`, cut by the training pipeline itself
    (`jaxlong.data.make_dataset` with the run's `seq_len`, `data.packing` and `data.split_positions`; no
    shuffle, one pass): each document is `[BOS] ids [EOS]` in its own segment, positions restart per document
    (or per piece of a long one), padding is masked. A training batch of the same documents has the same
    segment ids, positions and loss mask.

    Returns at most `n_batches` host batches `{'inputs', 'targets', 'positions', 'segment_ids' int32, 'mask'
    float32}` of `[eval_batch_size(cfg), seq_len]`; fewer when the documents cannot fill them.
    """
    from jaxlong.data import DocumentSubset, make_dataset  # noqa: PLC0415

    d = cfg.data
    ds = make_dataset(DocumentSubset(source, indices), tokenizer, seq_len=cfg.seq_len,
                      global_batch=eval_batch_size(cfg), seed=cfg.seed, packing=d.packing,
                      split_positions=d.split_positions, shuffle=False, repeat=False)
    return list(itertools.islice(iter(ds), n_batches))


def validation_split(cfg: Config, source, tokenizer, n_batches: int | None = None) -> tuple[list[int], list[dict]]:
    """The held-out documents of a run and its validation batches: what the trainer validates on, and what
    `python -m jaxlong.eval` evaluates (the same documents for the same `eval_fraction`, `seed`, corpus and
    batch count).

    Documents are held out (`held_out_documents`) until their tokens would fill `n_batches` (default
    `eval_batches`) batches of `eval_batch_size(cfg) x seq_len`; when packing leaves the batches short (padding,
    streams of unequal length), half as many tokens again are asked for, until the batches are full.

    Returns `(indices, batches)`: the held-out document indices (sorted) and `n_batches` host batches
    (`validation_batches`).

    Raises:
      ValueError: fewer than two documents, or all documents but one cannot fill the batches (the message names
        `eval_batches`, `eval_fraction` and `data.path`).
    """
    n_batches = n_batches or cfg.eval_batches
    need = n_batches * eval_batch_size(cfg) * cfg.seq_len + 1
    while True:
        indices = held_out_documents(source, tokenizer, cfg.eval_fraction, cfg.seed, need)
        batches = validation_batches(cfg, source, tokenizer, indices, n_batches)
        if len(batches) == n_batches:
            return indices, batches
        if len(indices) >= len(source) - 1:
            raise ValueError(
                f"eval_batches={n_batches}: the corpus of {len(source)} documents ({cfg.data.path}) cannot fill "
                f"{n_batches} validation batches of {eval_batch_size(cfg)} x seq_len={cfg.seq_len} tokens while "
                f"keeping a document for training; lower eval_batches or seq_len, or use a larger corpus"
            )
        need += need // 2


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
    untouched, in the input layout of `jaxlong.training.step.put_batch`), by the train step's forward
    (`jaxlong.training.step.loss_sum_fn`). Jitted with the parameters' FSDP shardings and the train step's batch
    sharding (`jaxlong.training.step.batch_sharding`); nothing is donated."""
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)

    def eval_step(params, batch):
        return step_lib.loss_sum_fn(params, batch, graphdef, rt)

    return jax.jit(eval_step, in_shardings=(_param_shardings(cfg, mesh), step_lib.batch_sharding(mesh)),
                   out_shardings=(replicated(mesh), replicated(mesh)))


def compile_eval_step(cfg: Config, mesh: jax.sharding.Mesh):
    """Ahead-of-time compile of `make_eval_step` (nothing allocated); `memory_analysis()` gives its per-device
    bytes, to print next to the train step's."""
    params = step_lib.abstract_state(cfg, mesh)["params"]
    return make_eval_step(cfg, mesh).lower(params, step_lib.abstract_batch(cfg, mesh, eval_batch_size(cfg))).compile()


def evaluate_loss(eval_step, params: dict, batches, mesh: jax.sharding.Mesh) -> dict:
    """Mean held-out loss over `batches` (host dicts, the same on every process), combined by sums:
    `{'loss': nats/token, 'perplexity': exp(loss), 'tokens': valid tokens}`. `eval_step`: `make_eval_step` or
    its compiled form."""
    total, count = 0.0, 0.0
    for batch in batches:
        s, c = eval_step(params, step_lib.put_batch(batch, mesh, process_local=False))
        total, count = total + float(s), count + float(c)
    loss = total / max(count, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": count}


# ----------------------------------------------------------------------------------------------
# Per-token loss and argmax over sequence tiles.


def tiled_token_stats(hidden: jax.Array, head: jax.Array, targets: jax.Array, *, tile: int,
                      mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """Per-token next-token loss and argmax without materializing `[batch, seq, vocab]` logits.

    Args:
      hidden: final hidden states `[batch, seq, hidden]`; with `mesh`, batch over data x fsdp and sequence over
        ring x context (`jaxlong.core.mesh.activation_spec`).
      head: output projection `[hidden, vocab]`, replicated.
      targets: next-token ids `[batch, seq]` int32.
      tile: tokens per tile along the (local) sequence; must divide seq (mesh None) or seq / (ring x context).
      mesh: the `data x fsdp x ring x context` mesh, or None to run on the arrays as given.

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
    tok = P(BATCH_AXES, seq_axes(mesh))
    return jax.shard_map(local, mesh=mesh, in_specs=(P(BATCH_AXES, seq_axes(mesh), None), P(), tok),
                         out_specs=(tok, tok), check_vma=True)(hidden, head, targets)


def make_token_stats_step(cfg: Config, mesh: jax.sharding.Mesh):
    """`stats(params, batch) -> (loss [b, s] float32, argmax [b, s] int32)`: the train step's forward, then
    `tiled_token_stats` with `tiling.loss_tile` or `default_loss_tile` (always tiled). Jitted; the batch may
    have any `[b, s]` shape the mesh divides (one compile per shape). The batch and both results are in the
    train step's input layout (`jaxlong.training.step.put_batch`); `token_stats` wraps it for host batches."""
    graphdef = model_lib.model_graphdef(cfg)
    rt = model_lib.Runtime(mesh=mesh, cfg=cfg)
    tok = step_lib.batch_sharding(mesh)

    def stats(params, batch):
        segment_ids = batch.get("segment_ids") if cfg.data.packing == "documents" else None
        hidden, head = model_lib.forward(graphdef, params, batch["inputs"], rt, batch.get("positions"), segment_ids)
        b, s = batch["targets"].shape
        s_local = s // seq_shards(mesh)
        b_local = max(b // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
        tile = cfg.tiling.loss_tile if cfg.tiling.loss_tile and s_local % cfg.tiling.loss_tile == 0 else \
            default_loss_tile(s_local, head.shape[-1], batch=b_local)
        return tiled_token_stats(hidden, head, batch["targets"], tile=tile, mesh=mesh)

    return jax.jit(stats, in_shardings=(_param_shardings(cfg, mesh), tok), out_shardings=(tok, tok))


def token_stats(cfg: Config, mesh: jax.sharding.Mesh) -> Callable[[dict, dict], tuple[np.ndarray, np.ndarray]]:
    """`fn(params, host_batch) -> (loss, argmax)`: `make_token_stats_step` on a host batch (the same on every
    process), placed by `jaxlong.training.step.put_batch`, with the results back on the host in token order
    (`jaxlong.training.step.natural_order`): float32 and int32 numpy `[b, s]`, equal to one device's on any mesh."""
    step = make_token_stats_step(cfg, mesh)

    def fn(params: dict, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        loss, argmax = jax.device_get(step(params, step_lib.put_batch(batch, mesh, process_local=False)))
        return step_lib.natural_order(loss, mesh), step_lib.natural_order(argmax, mesh)

    return fn


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
    """Validation in the train loop: the fixed validation batches (`validation_split`) and the AOT-compiled
    eval step. `compile()` compiles the eval step ahead of time; `due(step)` says whether to validate after
    `step` (every `eval_every` steps and after the last); `run(params)` returns `{'loss', 'perplexity',
    'tokens'}`."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh, batches: list[dict]):
        self.cfg, self.mesh, self.batches = cfg, mesh, batches
        self.compiled = None

    def compile(self):
        """AOT-compile the eval step; returns the `jax.stages.Compiled` (for its `memory_analysis`)."""
        self.compiled = compile_eval_step(self.cfg, self.mesh)
        return self.compiled

    def due(self, step: int) -> bool:
        every = self.cfg.eval_every
        return bool(every) and (step % every == 0 or step == self.cfg.steps)

    def run(self, params: dict) -> dict:
        return evaluate_loss(self.compiled, params, self.batches, self.mesh)


# ----------------------------------------------------------------------------------------------
# Everything at once: what `python -m jaxlong.eval` reports.


@dataclass(frozen=True)
class PasskeyGrid:
    """The passkey grid of `evaluate_params`: context `lengths` (tokens; each a sequence length the mesh takes),
    needle `depths` in [0, 1], `per_cell` examples per cell, `digits` per key."""

    lengths: list[int]
    depths: list[float]
    per_cell: int = 4
    digits: int = 5


@dataclass
class Evaluation:
    """Results of `evaluate_params`: validation `loss` (nats/token), `perplexity`, valid `tokens`,
    `by_position` (`PositionLoss.rows()`), `token_loss` (float32 `[b, seq_len]` per validation batch, token
    order) and `passkey` (float `[depths, lengths]` accuracy, or None)."""

    loss: float
    perplexity: float
    tokens: float
    by_position: list[dict]
    token_loss: list[np.ndarray]
    passkey: np.ndarray | None = None

    def summary(self, step: int, grid: PasskeyGrid | None = None) -> dict:
        """The JSON summary `python -m jaxlong.eval` writes (`summary.json`)."""
        out = {"step": step, "loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens,
               "loss_by_position": self.by_position}
        if self.passkey is not None and grid is not None:
            out["passkey"] = {"lengths": grid.lengths, "depths": grid.depths, "accuracy": self.passkey.tolist(),
                              "mean": float(np.mean(self.passkey)), "per_cell": grid.per_cell, "digits": grid.digits}
        return out


def evaluate_params(cfg: Config, mesh: jax.sharding.Mesh, params: dict, batches: list[dict], *,
                    eval_step=None, encode: Callable[[str], np.ndarray] | None = None,
                    passkey: PasskeyGrid | None = None, progress: Callable[[int], None] | None = None) -> Evaluation:
    """Validation loss, loss by position and (with `passkey` and `encode`) passkey retrieval of `params` on
    `mesh`, every batch in the train step's input layout (`jaxlong.training.step.put_batch`): on any mesh the result
    equals one device's up to float32 rounding.

    Args:
      cfg: the run's config (model, seq_len, tiling, mesh); mesh: its mesh.
      params: parameters in the FSDP shardings of `jaxlong.training.step.abstract_state(cfg, mesh)`.
      batches: host validation batches `[eval_batch_size(cfg), seq_len]` (`validation_split`).
      eval_step: `make_eval_step` or its compiled form (default: `make_eval_step(cfg, mesh)`).
      encode: tokenizer `str -> int [n]` (passkey); passkey: the grid, or None to skip it.
      progress: called with the number of sequences after each forward.
    """
    step = eval_step or make_eval_step(cfg, mesh)
    val = evaluate_loss(step, params, batches, mesh)
    if progress:
        progress(len(batches) * eval_batch_size(cfg))
    stats = token_stats(cfg, mesh)
    by_pos, token_loss = PositionLoss(cfg.seq_len), []
    for batch in batches:
        loss, _ = stats(params, batch)
        by_pos.add(loss, batch["mask"])
        token_loss.append(loss)
        if progress:
            progress(len(batch["inputs"]))
    acc = None
    if passkey is not None and encode is not None:
        acc = score_passkey(lambda b: stats(params, b)[1], encode, lengths=passkey.lengths, depths=passkey.depths,
                            per_cell=passkey.per_cell, batch_size=eval_batch_size(cfg), digits=passkey.digits,
                            seed=cfg.seed, progress=progress)
    return Evaluation(val["loss"], val["perplexity"], val["tokens"], by_pos.rows(), token_loss, acc)

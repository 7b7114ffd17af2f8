"""Evaluation steps: held-out loss on the training mesh, per-token loss and argmax, and `evaluate_params`, which
runs validation loss, loss by position and passkey retrieval for given parameters (what `python -m jaxlong.eval`
reports).

Long-context users check three things (LongLoRA, arXiv 2309.12307, §4; RULER, arXiv 2404.06654): the held-out
loss at the training length, how the loss falls with token position (a model that uses its context keeps
improving deep into the window), and retrieval of a fact planted far back (passkey, `jaxlong.evaluation.probes`).

* `make_eval_step` is the forward half of the train step: the same mesh, context parallelism (Ulysses, U-Pipe,
  ring and the hybrids), remat and tiling, returning the objective's loss *sum*, metric sums and denominator
  (`jaxlong.objectives.base.Objective`) so batches combine exactly. It takes only the parameters (no optimizer
  state, no gradients), so it fits wherever the train step fits.
* `make_token_stats_step` returns per-token loss and argmax `[batch, seq]`. It always works over sequence tiles
  of each device's local sequence (`tiling.loss_tile`, or the 256 MiB float32 logits budget of
  `jaxlong.layers.tiled.default_loss_tile`): `[seq, vocab]` logits never exist on a device, whatever the length.

Every batch goes onto the mesh through `jaxlong.core.batch.put_batch`, the train step's input layout (the
zigzag order under ring attention), and per-token results come back through `jaxlong.core.batch.natural_order`:
the results are those of one device on every mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxlong.config import Config, objective_of, runtime
from jaxlong.core.batch import batch_sharding, natural_order, put_batch
from jaxlong.core.mesh import BATCH_AXES, replicated, seq_axes, seq_shards
from jaxlong.data.heldout import eval_batch_size
from jaxlong.data.pipeline import PAIR_FEATURE
from jaxlong.evaluation.probes import PositionLoss, score_passkey
from jaxlong.layers.tiled import loss_tile, validate_loss_tile
from jaxlong.models import llama as model_lib
from jaxlong.objectives.base import Objective, forward
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training import step as step_lib

# ----------------------------------------------------------------------------------------------
# Eval step: the objective's held-out loss on the training mesh.


def param_shardings(cfg: Config, mesh) -> dict:
    """The parameters' FSDP shardings on `mesh` (`jaxlong.training.step.abstract_params`)."""
    return jax.tree.map(lambda x: x.sharding, step_lib.abstract_params(cfg, mesh))


def make_eval_step(cfg: Config, mesh: jax.sharding.Mesh, objective: Objective | None = None):
    """`eval_step(params, batch) -> (loss_sum, sums, denominator)`: the objective's loss sum, metric sums and
    denominator of `batch` (default the run's objective: the next-token cross-entropy summed over the counted
    targets, and their count), float32 and replicated, by the train step's forward. `batch` holds `[batch, seq]`
    arrays in the input layout of `jaxlong.core.batch.put_batch`. Jitted with the parameters' FSDP shardings and
    the train step's batch sharding; nothing is donated."""
    objective = objective or objective_of(cfg)
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)

    def eval_step(params, batch):
        loss, sums = objective.sums(params, batch, graphdef, rt)
        return loss, sums, objective.denominator(batch, mesh)

    return jax.jit(eval_step, in_shardings=(param_shardings(cfg, mesh), batch_sharding(mesh)),
                   out_shardings=replicated(mesh))


def compile_eval_step(cfg: Config, mesh: jax.sharding.Mesh, objective: Objective | None = None):
    """Ahead-of-time compile of `make_eval_step` (nothing allocated) on the run's batches (their entries are the
    run's objective's, whatever `objective` sums; a run without a held-out loss of its own, GRPO's, holds out
    plain documents); `memory_analysis()` gives its per-device bytes."""
    run_objective = objective_of(cfg)
    held_out = run_objective if run_objective.held_out_loss else LanguageModeling()
    batch = step_lib.abstract_batch(cfg, mesh, eval_batch_size(cfg), objective=held_out)  # what its batches carry
    return make_eval_step(cfg, mesh, objective).lower(step_lib.abstract_params(cfg, mesh), batch).compile()


def evaluate_loss(eval_step, params: dict, batches, mesh: jax.sharding.Mesh, objective: Objective,
                  after: Callable[[dict], None] | None = None) -> dict:
    """The objective's held-out results over `batches` (host dicts, the same on every process), combined by sums
    (`Objective.summary`: for language modelling `{'loss': nats/token, 'perplexity', 'tokens'}`). `eval_step`:
    `make_eval_step` or its compiled form; `after(batch)`, when given, runs after each batch's forward
    (`evaluate_params` takes the batch's per-token losses there).

    The denominator is counted on the host where the objective can (the counted targets in float64, exact at any
    length: the step's float32 count rounds once a sum passes 2^24 tokens, docs/numerics.md)."""
    loss, sums, count = 0.0, {}, 0.0
    for batch in batches:
        batch = {k: v for k, v in batch.items() if k != PAIR_FEATURE}
        l, s, n = eval_step(params, put_batch(batch, mesh))
        # replicated scalars: each process reads its own copy (not fully addressable with several processes)
        loss += float(l.addressable_data(0))
        for k, v in s.items():
            sums[k] = sums.get(k, 0.0) + float(v.addressable_data(0))
        host = objective.host_denominator(batch)
        count += float(n.addressable_data(0)) if host is None else host
        if after is not None:
            after(batch)
    return objective.summary(loss, sums, count)


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
    train step's input layout (`jaxlong.core.batch.put_batch`); `token_stats` wraps it for host batches."""
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    tok = batch_sharding(mesh)

    def stats(params, batch):
        hidden, head = forward(params, batch, graphdef, rt)
        b, s = batch["targets"].shape
        b_local = max(b // (mesh.shape["data"] * mesh.shape["fsdp"]), 1)
        tile = loss_tile(cfg.tiling, s // seq_shards(mesh), head.shape[-1], b_local)
        return tiled_token_stats(hidden, head, batch["targets"], tile=tile, mesh=mesh)

    return jax.jit(stats, in_shardings=(param_shardings(cfg, mesh), tok), out_shardings=(tok, tok))


def token_stats(cfg: Config, mesh: jax.sharding.Mesh) -> Callable[[dict, dict], tuple[np.ndarray, np.ndarray]]:
    """`fn(params, host_batch) -> (loss, argmax)`: `make_token_stats_step` on a host batch (the same on every
    process), placed by `jaxlong.core.batch.put_batch`, with the results back on the host in token order
    (`jaxlong.core.batch.natural_order`): float32 and int32 numpy `[b, s]`, equal to one device's on any mesh."""
    step = make_token_stats_step(cfg, mesh)

    def fn(params: dict, batch: dict) -> tuple[np.ndarray, np.ndarray]:
        loss, argmax = (_to_host(x) for x in step(params, put_batch(batch, mesh)))
        return natural_order(loss, mesh), natural_order(argmax, mesh)

    return fn


def _to_host(x: jax.Array) -> np.ndarray:
    """The whole of a global array on the host of every process (gathered across processes when they share it)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


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


def sequences_to_evaluate(cfg: Config, batches: list[dict], passkey: PasskeyGrid | None = None) -> int:
    """The total of `evaluate_params`'s `progress` counts (a progress bar's length): each validation sequence
    once, and each passkey example (`per_cell` per cell)."""
    n = sum(len(b["inputs"]) for b in batches)
    if passkey is not None:
        n += len(passkey.lengths) * len(passkey.depths) * passkey.per_cell
    return n


def evaluate_params(cfg: Config, mesh: jax.sharding.Mesh, params: dict, batches: list[dict], *,
                    eval_step=None, encode: Callable[[str], np.ndarray] | None = None,
                    passkey: PasskeyGrid | None = None, progress: Callable[[int], None] | None = None,
                    stats=None) -> Evaluation:
    """Validation loss, loss by position and (with `passkey` and `encode`) passkey retrieval of `params` on
    `mesh`, every batch in the train step's input layout (`jaxlong.core.batch.put_batch`): on any mesh the result
    equals one device's up to float32 rounding.

    Args:
      cfg: the run's config (model, seq_len, tiling, mesh); mesh: its mesh.
      params: parameters in the FSDP shardings of `jaxlong.training.step.abstract_params(cfg, mesh)`.
      batches: host validation batches `[eval_batch_size(cfg), seq_len]` (`validation_split`).
      eval_step: `make_eval_step` of language modelling or its compiled form (default: made here).
      encode: tokenizer `str -> int [n]` (passkey); passkey: the grid, or None to skip it.
      progress: called with the number of sequences (validation sequences, then passkey examples) once each is
        done: a validation sequence counts once, after both of its forwards (loss sum, per-token loss).
      stats: a `token_stats(cfg, mesh)` to share with other probes (e.g. RULER's `score_on_mesh`: its jitted
        program is compiled once per batch shape), or None to make one.
    """
    step = eval_step or make_eval_step(cfg, mesh, LanguageModeling())
    stats = stats or token_stats(cfg, mesh)
    by_pos, token_loss = PositionLoss(cfg.seq_len), []

    def per_token(batch: dict) -> None:  # right after the batch's loss sum
        loss, _ = stats(params, batch)
        by_pos.add(loss, batch["mask"])
        token_loss.append(loss)
        if progress:
            progress(len(batch["inputs"]))

    val = evaluate_loss(step, params, batches, mesh, LanguageModeling(), after=per_token)
    acc = None
    if passkey is not None and encode is not None:
        acc = score_passkey(lambda b: stats(params, b)[1], encode, lengths=passkey.lengths, depths=passkey.depths,
                            per_cell=passkey.per_cell, batch_size=eval_batch_size(cfg), digits=passkey.digits,
                            seed=cfg.seed, progress=progress)
    return Evaluation(val["loss"], val["perplexity"], val["tokens"], by_pos.rows(), token_loss, acc)

"""Batches of one's own for the train loop: a function of the step in place of the corpus pipeline.

The train loop (`jaxlong.training.loop.run`) reads its batches from the corpus (`jaxlong.data.batch_iterator`:
packing, mixtures, its state saved with each checkpoint). A probe that trains on synthetic tasks (passkey
retrieval, RULER's needles, copying) passes `run(cfg, batches=fn)` instead, where `fn(step, rows)` returns the
host batch of global step `step` for the rows `rows` of the global batch; everything else is the trainer's own
(mesh, compiled step, checkpoints, `--resume`, SIGTERM, TensorBoard, hooks). The function must depend on the
step alone (seed a generator with it), so that a resumed run is fed exactly what an uninterrupted one was: the
checkpoint records only the step.

An on-policy source (RL's rollouts, `jaxlong.rl`) is a `PolicyBatchFn`: `fn(step, rows, params)` also reads the
parameters the step starts from (FSDP-sharded, read-only: the step donates them after the call), so that sampling
uses the current policy without a copy. Its batches may carry the objective's own entries
(`Objective.batch_keys`, e.g. GRPO's `advantages`), checked as the others.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxlong.layers.loss import IGNORE_INDEX

__all__ = ["BatchFn", "PolicyBatchFn", "StepBatches", "BATCH_KEYS"]

BatchFn = Callable[[int, np.ndarray], dict]


class PolicyBatchFn:
    """A batch source that reads the current parameters: `fn(step, rows, params) -> dict` (module docstring).
    Subclass it (or set `on_policy = True` on a callable) to be called with the parameters."""

    on_policy = True

    def __call__(self, step: int, rows: np.ndarray, params: dict) -> dict:
        raise NotImplementedError

# What the compiled train step reads (`jaxlong.training.step.abstract_batch`), with their dtypes.
BATCH_KEYS = {"inputs": np.int32, "targets": np.int32, "mask": np.float32, "positions": np.int32,
              "segment_ids": np.int32}


class StepBatches:
    """The train loop's batch iterator over `fn(step, rows)` (`BatchFn`).

    Args:
      fn: `fn(step, rows) -> dict` of numpy arrays `[len(rows), seq_len]` with the keys of `BATCH_KEYS`
        (`inputs`, `targets` token ids; `mask` the loss weight of each target, float; `positions` within each
        document; `segment_ids` the document of each token, 0 = padding); `step` is the global step (1-based),
        `rows` this process's sorted global row indices (`jaxlong.core.batch.process_rows`).
      rows: those row indices.
      seq_len: tokens per row.
      vocab_size: the model's vocabulary: `inputs` in [0, vocab_size), `targets` too or `IGNORE_INDEX` (-100).
      start: the step already done (the run's first batch is `fn(start + 1, rows)`).
      extra_keys: `{key: dtype}` of the objective's own `[rows, seq_len]` entries (`Objective.batch_keys`).
    With `fn.on_policy` (`PolicyBatchFn`) the train loop calls `next_for(params)` and `fn` gets the parameters.
    """

    def __init__(self, fn: BatchFn, rows: np.ndarray, seq_len: int, vocab_size: int, start: int = 0,
                 extra_keys: dict | None = None):
        self.fn, self.rows, self.seq_len, self.step = fn, np.asarray(rows, np.int64), int(seq_len), int(start)
        self.vocab_size = int(vocab_size)
        self.keys = {**BATCH_KEYS, **(extra_keys or {})}
        self.on_policy = bool(getattr(fn, "on_policy", False))

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        return self.next_for(None)

    def next_for(self, params: dict | None) -> dict:
        """The next step's batch (an on-policy `fn` called with `params`), cast to `BATCH_KEYS`' dtypes and the
        objective's.

        Raises:
          ValueError: not a dict, a key is missing, an array is not `[len(rows), seq_len]`, ids are not integers,
            a token id is outside the vocabulary, a position or segment id is negative, or a mask weight is not a
            finite number >= 0 (the message names the key and the step).
        """
        self.step += 1
        batch = self.fn(self.step, self.rows, params) if self.on_policy else self.fn(self.step, self.rows)
        where = f"batches: fn({self.step}, rows)"
        want = (self.rows.size, self.seq_len)
        if not isinstance(batch, dict):
            raise ValueError(f"{where} returned {type(batch).__name__}; it must return a dict of "
                             f"{', '.join(BATCH_KEYS)}, each [rows={want[0]}, seq_len={want[1]}]")
        missing = [k for k in self.keys if k not in batch]
        if missing:
            raise ValueError(f"{where} returned no {', '.join(missing)}; a batch has "
                             f"{', '.join(BATCH_KEYS)}, each [rows={want[0]}, seq_len={want[1]}]")
        out = {}
        for k, dtype in self.keys.items():
            arr = np.asarray(batch[k])
            if arr.shape != want:
                raise ValueError(f"{where}[{k!r}] has shape {arr.shape}; it must be [rows, "
                                 f"seq_len] = {list(want)} (rows: this process's {want[0]} rows of the global "
                                 f"batch)")
            numeric = np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_
            floats = k == "mask" or np.issubdtype(dtype, np.floating)
            if floats and not numeric or not floats and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"{where}[{k!r}] has dtype {arr.dtype}; it must be "
                                 + ("a number per target (a loss weight)" if k == "mask" else "numbers" if floats else
                                    "integers"))
            out[k] = arr.astype(dtype, copy=False)
        self._check_values(out, where)
        return out

    def _check_values(self, batch: dict, where: str) -> None:
        """Ids in range, weights finite and >= 0 (an id outside the vocabulary would train on NaN silently)."""
        def bad(k, values, allowed):
            raise ValueError(f"{where}[{k!r}] holds {values}; {allowed}")

        v = self.vocab_size
        if batch["inputs"].min() < 0 or batch["inputs"].max() >= v:
            bad("inputs", f"ids {batch['inputs'].min()}..{batch['inputs'].max()}", f"token ids are in [0, {v}) "
                f"(model.vocab_size={v})")
        t = batch["targets"]
        if ((t < 0) & (t != IGNORE_INDEX)).any() or t.max() >= v:
            bad("targets", f"ids {t.min()}..{t.max()}", f"token ids are in [0, {v}) (model.vocab_size={v}), or "
                f"{IGNORE_INDEX} for no loss")
        for k in ("positions", "segment_ids"):
            if batch[k].min() < 0:
                bad(k, f"{batch[k].min()}", "they are >= 0 (segment id 0: padding)")
        m = batch["mask"]
        if not np.isfinite(m).all() or m.min() < 0:
            bad("mask", f"weights {m.min()}..{m.max()}", "loss weights are finite and >= 0")

    def get_state(self) -> dict:
        """The step of the last batch (all a resume needs: the batches are a function of the step)."""
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        """Continue after the state's step (`get_state`)."""
        self.step = int(state["step"])

    @staticmethod
    def merge_states(states: list[dict]) -> dict:
        """One state from every process's `get_state()` (all at the same step)."""
        return states[0]

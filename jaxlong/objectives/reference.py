"""The frozen reference of DPO, precomputed: each pair's summed response log-probabilities under the reference
weights, computed in one pass before the first DPO step and kept in `RUN_DIR/reference/stage<k>.npz`
(docs/post-training.md).

So the reference costs no device memory while training, and a resume needs nothing that checkpoint rotation could
delete (with `keep_checkpoints=2` the checkpoint a stage started from is gone a few saves later). The pass is the
train step's forward (`jaxlong.objectives.base.token_losses`) on the run's mesh, over every pair of the source,
held-out pairs included, packed by the training pipeline in file order; each half's log-probs summed per segment
(`segment_sums`). The pipeline then puts each half's sum at the half's first position (`reference`).

The reference weights (`dpo.reference`): `policy`, the weights the run starts from (`model.from_hf`, or the
checkpoint a recipe's stage starts from, or a fresh initialization), or a Hugging Face model directory.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlong.core import segments
from jaxlong.core.errors import ConfigError
from jaxlong.core.mesh import replicated
from jaxlong.core.batch import batch_sharding, put_batch
from jaxlong.data.pipeline import PAIR_FEATURE, PipelineOptions, make_dataset
from jaxlong.layers import loss as loss_lib
from jaxlong.models import hf
from jaxlong.models.config import ModelConfig
from jaxlong.objectives.base import Preparation, segment_sums, token_losses

__all__ = ["half_ids", "reference_file", "reference_key", "compute_reference", "prepare_reference", "check_reference"]


def half_ids(segment_ids):
    """Each token's half as DPO sums it, int32 `[batch, seq]` (numpy or JAX in, the same out): the k-th pair's
    segment ids `2k - 1` (chosen) and `2k` (rejected), which a pair that holds its prompt once
    (`data.shared_prompt`: document k, branches 1 and 2, `jaxlong.core.segments`) gets from its branches too. A
    shared prompt's tokens keep their id: they carry no loss mask and no reference, so they add 0 to any sum."""
    b = segments.branches(segment_ids)
    return jnp.where(b > 0, 2 * segments.documents(segment_ids) - 2 + b, segment_ids)


def reference_file(run_dir: str | Path, stage: int) -> Path:
    """`RUN_DIR/reference/stage<stage>.npz`: one recipe stage's reference log-probs."""
    return Path(run_dir) / "reference" / f"stage{stage}.npz"


def reference_key(reference: str, stage: int, source) -> dict:
    """What the stored log-probs depend on: the pairs (their count and the digest of their tokens and loss masks,
    wherever the file lies), `dpo.reference` and the stage. A stored file with another key is refused."""
    return {"pairs": len(source), "tokens_sha256": source.digest, "reference": reference, "stage": stage}


def compute_reference(run: Preparation, params: dict) -> np.ndarray:
    """Each pair's summed response log-probs under `params`, float64 `[len(run.source), 2]` (chosen, rejected), in
    nats: the train step's forward (`run.graphdef`, `run.rt`) over every pair of `run.source` (a
    `PreferenceSource`), packed by the training pipeline in file order into batches of `global_batch / grad_accum`
    rows (the last one padded), on the run's mesh."""
    cfg, source, mesh = run.cfg, run.source, run.rt.mesh
    d = cfg.data

    def sums(p, batch):
        logps = -token_losses(p, batch, run.graphdef, run.rt)
        counted = loss_lib.effective_mask(batch["targets"], batch["mask"])
        return segment_sums(jnp.where(counted > 0, logps, 0.0), half_ids(batch["segment_ids"]), mesh)

    shardings = jax.tree.map(lambda x: x.sharding, params)
    fn = jax.jit(sums, in_shardings=(shardings, batch_sharding(mesh)), out_shardings=replicated(mesh))
    rows = make_dataset(source, run.tokenizer, seq_len=cfg.seq_len, global_batch=1,
                        options=PipelineOptions(seed=cfg.seed, packing=d.packing, shuffle=False, repeat=False,
                                                read_threads=d.read_threads, read_buffer=d.read_buffer))
    per = cfg.global_batch // cfg.grad_accum
    out = np.full((len(source), 2), np.nan)
    keys = ("inputs", "targets", "mask", "positions", "segment_ids")

    def run_group(group):
        batch = {k: np.concatenate([r[k] for r in group]) for k in (*keys, PAIR_FEATURE)}
        pad = per - len(group)
        batch = {k: np.pad(v, ((0, pad), (0, 0))) for k, v in batch.items()}
        got = np.asarray(fn(params, put_batch({k: batch[k] for k in keys}, mesh)).addressable_data(0))
        halves = np.asarray(half_ids(batch["segment_ids"]))
        for r in range(per):
            half, pair = np.where(batch["mask"][r] > 0, halves[r], 0), batch[PAIR_FEATURE][r]
            for s in np.unique(half[half > 0]):  # each half by its first trained token
                first = np.flatnonzero(half == s)[0]
                out[pair[first] - 1, (s - 1) % 2] = got[r, s - 1]

    rows = iter(rows)
    while group := list(itertools.islice(rows, per)):
        run_group(group)
    if np.isnan(out).any():  # every pair goes through the packer once
        raise RuntimeError(f"the reference pass missed {int(np.isnan(out).any(axis=1).sum())} pairs")
    return out


def prepare_reference(run: Preparation, reference: str) -> Path:
    """Give `run.source` (a `PreferenceSource`) its reference log-probs (`source.reference`): read from
    `reference_file(run.run_dir, stage)` when it holds this key, else computed (`compute_reference`) with the
    weights `reference` names (`dpo.reference`: `policy`, the weights the run starts from, or a Hugging Face
    directory) and written there (by process 0, atomically) before training starts.

    Raises:
      ValueError: the file is missing or holds other pairs or another reference, and the reference weights are
        gone (a resume inside the stage with `dpo.reference: policy`: `run.start_params` is None).
    """
    source, stage, say = run.source, run.cfg.stage, run.say
    path = reference_file(run.run_dir, stage)
    key = reference_key(reference, stage, source)
    gone = run.start_params is None and reference == "policy"
    if path.is_file():
        with np.load(path) as f:
            saved, logps = json.loads(str(f["key"])), np.asarray(f["logps"])
        if saved == key:
            source.reference = logps
            say(f"reference log-probs of {len(source):,} pairs read from {path}")
            return path
        if gone:
            what = "other pairs" if (saved.get("pairs"), saved.get("tokens_sha256")) != (
                key["pairs"], key["tokens_sha256"]) else "another reference or stage"
            raise ValueError(f"{path} holds the reference log-probs of {what} ({_differ(saved, key)}), and the "
                             f"weights this stage started from are no longer what the run resumes from; resume with "
                             f"the stage's data and dpo.reference, or start the stage again")
    elif gone:
        raise ValueError(f"{path} is missing: the reference log-probs were computed when the stage started, and the "
                         f"weights it started from are no longer what the run resumes from; restore the file, or "
                         f"give dpo.reference a Hugging Face directory of those weights")
    if reference == "policy":
        params, what = run.start_params(), "the weights this run starts from"
    else:
        params, what = run.load_params(reference), reference
    say(f"reference log-probs of {len(source):,} pairs: one forward pass under {what}")
    logps = compute_reference(run, params)
    del params
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
        np.savez(tmp, logps=logps, key=np.array(json.dumps(key)))
        os.replace(tmp, path)
    source.reference = logps
    say(f"reference log-probs written to {path}")
    return path


def _differ(saved: dict, key: dict) -> str:
    return ", ".join(f"{k}: {saved.get(k)!r} there, {key[k]!r} now" for k in key if saved.get(k) != key[k])[:400]


def check_reference(reference: str, model: ModelConfig) -> None:
    """`dpo.reference`, when a Hugging Face directory, checked against the model before anything compiles.

    Raises:
      ConfigError: naming `dpo.reference` (no safetensors, tensors missing or of other shapes)."""
    if reference == "policy":
        return
    try:
        hf.check_checkpoint(reference, model)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.from_hf=", "dpo.reference=", 1)) from None

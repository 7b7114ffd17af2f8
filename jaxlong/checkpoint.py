"""Checkpoints with orbax: asynchronous, atomic (written to a temporary directory, then renamed), keeping
the last K. A checkpoint holds the train state, the config it was written with and the input pipeline's
iterator state (`data`, Grain's JSON state, see `jaxlong.data.pipeline`), so `--resume` continues with exactly
the next batch.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves `state` every `every` steps under `directory/<step>/`, keeping the last `keep`."""

    def __init__(self, directory: str | Path, *, every: int, keep: int):
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    @staticmethod
    def latest_in(directory: str | Path) -> int | None:
        """Latest committed checkpoint step in `directory` (None if there is none); creates nothing."""
        path = Path(directory)
        if not path.is_dir():
            return None
        steps = [int(p.name) for p in path.iterdir() if p.name.isdigit() and (p / "_CHECKPOINT_METADATA").exists()]
        return max(steps, default=None)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, config: dict, *, force: bool = False, data_state: dict | None = None) -> bool:
        """Start an asynchronous save of `state` at `step` (if due, or `force`), with the data iterator's state
        `data_state` (a JSON-serializable dict) when given. Returns whether it saved."""
        if not force and step % self.every:
            return False
        items = dict(state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config))
        if data_state is not None:
            items["data"] = ocp.args.JsonSave(data_state)
        return self.manager.save(step, args=ocp.args.Composite(**items), force=True)

    def restore(self, abstract_state: dict, step: int | None = None) -> tuple[int, dict]:
        """Restore the state at `step` (default: latest) into the shardings of `abstract_state`.

        Raises:
          FileNotFoundError: there is no checkpoint in the directory.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"--resume: no checkpoint found in {self.directory}")
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return step, restored["state"]

    def restore_data(self, step: int) -> dict | None:
        """The data iterator state saved at `step`, or None when that checkpoint has none."""
        if not (self.directory / str(step) / "data").exists():
            return None
        return self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]

    def wait(self) -> None:
        """Block until pending asynchronous saves are committed to disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(state: dict) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)

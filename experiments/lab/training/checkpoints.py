"""Orbax checkpoints of the model and optimizer state under ``<workdir>/checkpoints``."""

from __future__ import annotations

import pathlib

import jax
import orbax.checkpoint as ocp
from flax import nnx

from experiments.lab.training.workdir import CHECKPOINT_DIR, RunError


class Checkpoints:
    """Orbax checkpoints of the model and optimizer state under ``<workdir>/checkpoints``."""

    def __init__(self, workdir: pathlib.Path, every: int):
        self._dir = (workdir / CHECKPOINT_DIR).absolute()
        self._manager = ocp.CheckpointManager(
            self._dir,
            options=ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every),
            item_handlers=ocp.StandardCheckpointHandler(),  # lets item_metadata read shapes
        )

    def latest_step(self) -> int | None:
        """The step of the newest checkpoint, None when there is none."""
        return self._manager.latest_step()

    def restore(self, model, optimizer) -> int:
        """Restores the latest checkpoint into model and optimizer; returns its step (0: none).

        Raises:
          RunError: the checkpoint does not fit the model and optimizer (another model shape).
        """
        step = self._manager.latest_step()
        if step is None:
            return 0
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _state(model, optimizer))
        mismatches = self._mismatches(step, abstract)
        if mismatches:
            more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
            raise RunError(
                f"the checkpoint of step {step} in {self._dir} does not fit this model: "
                f"{mismatches[0]}{more}; resume with the flags that wrote it or choose another "
                f"--workdir"
            )
        try:
            restored = self._manager.restore(step, args=ocp.args.StandardRestore(abstract))
        except (ValueError, KeyError, TypeError) as err:
            # The first sentence of orbax's message (it names the shapes) is enough.
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            reason = reason.split(". ")[0][:200]
            raise RunError(
                f"the checkpoint of step {step} in {self._dir} does not fit this model "
                f"({reason}); resume with the flags that wrote it or choose another --workdir"
            ) from None
        for obj, key in ((model, "model"), (optimizer, "opt")):
            target = nnx.state(obj)
            nnx.replace_by_pure_dict(target, restored[key])
            nnx.update(obj, target)
        return step

    def _mismatches(self, step: int, abstract) -> list[str]:
        """How the arrays saved at ``step`` differ from ``abstract`` (missing, extra, or of
        another shape), checked on the checkpoint's metadata before restoring anything."""
        try:
            saved = self._manager.item_metadata(step)
        except Exception:  # noqa: BLE001 (unreadable metadata: restoring will say what is wrong)
            return []
        if saved is None:
            return []

        def shapes(tree) -> dict[str, tuple]:
            return {
                "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(
                    leaf.shape
                )
                for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
                if hasattr(leaf, "shape")
            }

        have, want = shapes(saved), shapes(abstract)
        out = []
        for name in sorted(have.keys() | want.keys()):
            if name not in have:
                out.append(f"{name} is not in the checkpoint")
            elif name not in want:
                out.append(f"the checkpoint holds {name}, which this model does not have")
            elif have[name] != want[name]:
                out.append(f"{name} is {have[name]} there, {want[name]} here")
        return out

    def save(self, step: int, model, optimizer, force: bool = False) -> bool:
        """Saves (in the background) when ``step`` is on the interval or ``force``; returns
        whether it saves."""
        state = _state(model, optimizer)
        return self._manager.save(step, args=ocp.args.StandardSave(state), force=force)

    def wait(self):
        """Blocks until every save started so far is on disk."""
        self._manager.wait_until_finished()

    def close(self):
        """Waits for the saves in flight, then releases the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _state(model, optimizer) -> dict:
    """What a checkpoint holds: the model's and the optimizer's state as plain nested dicts."""
    return {
        "model": nnx.to_pure_dict(nnx.state(model)),
        "opt": nnx.to_pure_dict(nnx.state(optimizer)),
    }

"""The rates file of `experiments.bench.rates` when a run measures only some of its parts: what
it keeps of the file it replaces. No flags, so that tests import it beside other programs."""

from __future__ import annotations

#: What ``--parts`` may name: the layer's rates, the rest of the training step.
PARTS = ("layer", "rest")
#: The top-level key whose presence says a rates file holds each part.
_PART_KEYS = {"layer": "modes", "rest": "rest"}
#: What a run of some parts keeps of the file: the layer rates' provenance, shape, calibration.
_KEPT = ("provenance", "shape", "calibration")


def merged(old: dict | None, new: dict, parts: list[str]) -> dict:
    """The rates file of a run that measured ``parts``: ``new`` over ``old`` (the file it
    replaces, None when there is none). A run of every part is the file whole; one of some parts
    keeps the others of ``old`` and its provenance, noting there which part this run
    re-measured when (``new``'s provenance). ValueError when ``old`` lacks a part not measured
    or has another shape."""
    if set(parts) == set(PARTS):
        return new
    if old is None:
        raise ValueError(f"--parts={','.join(parts)} needs an existing rates file to merge into")
    if _layer_shape(old) != _layer_shape(new):
        raise ValueError(
            f"the rates file's shape {_layer_shape(old)} is not this run's {_layer_shape(new)}"
        )
    missing = [p for p in PARTS if p not in parts and _PART_KEYS[p] not in old]
    if missing:
        raise ValueError(f"the rates file has no {', '.join(missing)} part to keep")
    out = {**old, **{k: v for k, v in new.items() if k not in _KEPT}}
    p = new["provenance"]
    note = f"re-measured alone on {p['date']}: {p['command']}, commit {p['commit']}"
    out["provenance"] = {**old["provenance"], f"remeasured_{'_'.join(parts)}": note}
    return out


def _layer_shape(rates: dict) -> dict:
    """A rates file's shape but its repeats (a part re-measured may repeat more)."""
    return {k: v for k, v in rates["shape"].items() if k != "repeats"}

"""ultraep_jax's stage names in MaxText's remat policies.

MaxText's decoder layers run under ``jax.checkpoint`` with the policy its ``remat_policy`` names
(``full``, its default, saves nothing: the backward pass recomputes the block, the planner
included). Its config refuses names it does not know, so `uep.remat`'s cannot be added there;
`with_saved` adds them to whatever policy MaxText builds (`Balancing.remat_saved`).
"""

from __future__ import annotations

import jax

from ultraep_jax import remat

#: The names by their short form (``plan`` for ``ultraep_plan``, ...), as the command takes them.
SHORT = {name.removeprefix("ultraep_"): name for name in remat.NAMES}


def with_saved(policy, names: tuple[str, ...]):
    """``policy`` (a `jax.checkpoint` policy, or None: save nothing) that also saves the values
    named ``names`` (of `uep.remat.NAMES`); ``policy`` itself when ``names`` is empty."""
    if not names:
        return policy
    ours = jax.checkpoint_policies.save_only_these_names(*names)
    if policy is None:
        return ours

    def saved_or_policy(prim, *args, **params):
        return True if ours(prim, *args, **params) else policy(prim, *args, **params)

    return saved_or_policy


def names_from_text(text: str) -> tuple[str, ...]:
    """``plan,dispatch`` (short or `uep.remat.NAMES` names), ``all`` or ``none`` as
    `uep.remat.NAMES` entries; raises one line naming an unknown one."""
    if text in ("", "none"):
        return ()
    if text == "all":
        return remat.NAMES
    return canonical(tuple(s.strip() for s in text.split(",")))


def canonical(names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` as `uep.remat.NAMES` entries; each may be spelled either way (``plan`` or
    ``ultraep_plan``); raises one line naming an unknown one."""
    unknown = [n for n in names if n not in SHORT and n not in remat.NAMES]
    if unknown:
        raise ValueError(
            f"maxtext: remat: unknown stage(s) {', '.join(map(str, unknown))}; the stages are "
            f"{', '.join(SHORT)} (or {', '.join(remat.NAMES)}), all or none"
        )
    return tuple(SHORT.get(n, n) for n in names)

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
    """``plan,dispatch`` (short names), ``all`` or ``none`` as `uep.remat.NAMES` entries; raises
    one line naming an unknown one."""
    if text in ("", "none"):
        return ()
    if text == "all":
        return remat.NAMES
    short = tuple(s.strip() for s in text.split(","))
    unknown = [s for s in short if s not in SHORT]
    if unknown:
        raise ValueError(
            f"maxtext: ultraep_remat: unknown stage(s) {', '.join(unknown)}; the stages are "
            f"{', '.join(SHORT)}, all or none"
        )
    return tuple(SHORT[s] for s in short)

"""The plan stage: the exact loads of a call and the plan made from them.

loads.py    each pair's expert (the rule for an id outside [0, E)), the loads [R, E] all-gathered
            over the EP axis, the plan without balancing
planner.py  `plan`: the planner chosen for the platform it is lowered for (the native
            planner's XLA FFI custom call, or portable.py's)
plan_type.py  `Plan`, the planner's result (what dispatch and the loads read)
native.py   loading the native libraries built from ffi/

The instance layout (expert e's master on rank e // E_m) is `ultraep_jax.base.layout`.
"""

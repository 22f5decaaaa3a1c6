"""The plan: which hot experts to replicate onto which ranks, and how many tokens each instance
takes. Computed by the native planner through an XLA FFI custom call (C++ on CPU, CUDA on GPU) or
by the portable planner (the same plans in JAX, `planning.portable`), so it runs inside
`jax.jit`, `vmap`, `lax.map` and `shard_map` with no host round-trip. Which planner a name is on
a platform is `config.resolve`'s rule; it is applied for each platform the computation is
lowered for (`_plan_lowering`)."""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.extend
import jax.interpreters.batching
import jax.interpreters.mlir
import jax.numpy as jnp
import numpy as np

from ultraep_jax._vma import vary, varying_axes
from ultraep_jax.base.arguments import INT64_MAX, check_int
from ultraep_jax.base.layout import check_divisible
from ultraep_jax.config import resolve
from ultraep_jax.config.balancer import BalancerConfig
from ultraep_jax.config.execution import PLANNERS, check_name
from ultraep_jax.planning import native as _native
from ultraep_jax.planning import portable as _portable
from ultraep_jax.planning.plan_type import Plan

_log = logging.getLogger("ultraep_jax")


def _check_loads(loads, config: BalancerConfig):
    """``loads`` as an array, and ``config`` sized from its shape [R, E]; raises one line for a
    wrong type, shape or dtype, or sizes that ``config`` states otherwise."""
    if not isinstance(config, BalancerConfig):
        raise TypeError(f"plan: config must be a BalancerConfig, got {type(config).__name__}")
    if not hasattr(loads, "dtype"):
        loads = np.asarray(loads)
    stated = [config.ep_size, config.num_experts]
    if loads.ndim == 2 and 0 in loads.shape:
        raise ValueError(
            f"plan: loads [ep_size, num_experts] must have both sizes >= 1, got {list(loads.shape)}"
        )
    if loads.ndim != 2 or any(
        v is not None and v != n for v, n in zip(stated, loads.shape, strict=True)
    ):
        want = "[ep_size, num_experts]"
        if stated != [None, None]:  # the sizes the BalancerConfig states, "any" for one it leaves
            sizes = ", ".join("any" if v is None else str(v) for v in stated)
            want += f" = [{sizes}] (or leave the sizes out of the BalancerConfig)"
        raise ValueError(f"plan: loads must have shape {want}, got {list(loads.shape)}")
    if loads.dtype != np.int32:
        raise TypeError(
            f"plan: loads must be int32, got {loads.dtype} (cast with .astype(np.int32))"
        )
    R, E = loads.shape
    check_divisible(E, R, "plan")
    return loads, dataclasses.replace(config, num_experts=E, ep_size=R)


def _check_capacity(capacity) -> int:
    """The FFI attribute for ``capacity``: 0 for None (unbounded), else the validated int."""
    if capacity is None:
        return 0
    return check_int("plan: capacity", capacity, 1, INT64_MAX)


def plan(
    loads,
    config: BalancerConfig,
    capacity: int | None = None,
    *,
    parallel: bool = False,
    planner: str = "auto",
) -> Plan:
    """Plans replicas and quotas for one expert-load matrix.

    Args:
        loads: int32 [R, E] (NumPy or JAX): ``loads[r, e]`` is the number of (token, choice) pairs
            on source rank ``r`` routed to expert ``e``; every entry must be >= 0. Inside
            `jax.shard_map` pass the all-gathered matrix, so that every rank computes the same plan.
        config: the balancer configuration. R and E are read from ``loads``' shape; a
            configuration that states them must agree.
        capacity: optional static int >= 1, the rows of each rank's receive buffer. The planner
            then tries thresholds at or below ``capacity`` (``capacity`` itself, then lower ones
            down to ``M = ceil(sum(loads) / R)``) before any above it, so no rank is planned above
            ``capacity`` when the search finds a plan that fits, even where ``balance_eps`` alone
            would tolerate more. When it finds none (for instance ``capacity < M``), the plan is
            the one without a capacity, and the caller detects that as ``max(plan.rank_load) >
            capacity``. None: no bound.
        parallel: run the parallel form of the planner (``ffi/planner_parallel.h``), which gives
            the same plan bit for bit: on CUDA one block of warps per plan (threshold probes on
            separate warps, the argmaxes as warp reductions); on the CPU the same code with the
            lanes emulated in loops (slower than the default; it is there to test that code).
            Opt-in until it has been timed and checked on a GPU. Native planner only: with
            ``planner="auto"``, lowering for a platform that plans portably (TPU, ROCm, CUDA
            without the handler, as in a `jax.export` for TPU) raises one line rather than plan
            serially. A ``numpy.bool_`` is accepted.
        planner: one of `PLANNERS`. "auto" (default) is resolved (`config.resolve`) for each
            platform the computation is lowered for (only that planner is traced and compiled;
            an export for TPU from a CPU process plans portably): the native handler on CPU, and
            on CUDA where the CUDA handler was built (`native.has_cuda_handler`); the portable
            planner elsewhere (TPU, ROCm, CUDA without the handler). Both give the same plan bit
            for bit.

    Returns:
        The `Plan`. The planner is a pure, deterministic function of ``loads``. Every plan is valid
        (each expert's quotas sum to its load, a rank holds at most ``slots_per_rank`` replicas
        and no expert twice) and never puts a rank above the most loaded rank before balancing.
        In exact mode (``balance_eps == 0``) every rank is at ``M`` whenever the search finds such
        a plan, and a ``capacity`` is met whenever it finds such a plan. Both are guaranteed
        whenever any plan reaches ``M`` (fits the capacity) if ``ep_size == 2`` or
        ``slots_per_rank >= num_experts - num_experts / ep_size``; otherwise the search is a
        heuristic, which missed 1 in 60,000 to 80,000 small random cases where a plan at ``M``
        exists (ffi/PLANNER.md, "What is guaranteed").

    Raises:
        ValueError / TypeError: wrong shape or dtype, or a bad ``capacity`` (before anything runs).
        A negative load is reported by the custom call when it runs on the CPU (a
        `jax.errors.JaxRuntimeError` naming the entry); on GPU, where a kernel cannot raise, every
        output of that plan is -1.
    """
    loads, config = _check_loads(loads, config)
    cap = _check_capacity(capacity)
    if not isinstance(parallel, (bool, np.bool_)):
        raise TypeError(
            f"plan: parallel must be a bool (or numpy.bool_), got {type(parallel).__name__} "
            f"{parallel!r}"
        )
    parallel = bool(parallel)
    check_name("planner", planner, PLANNERS, owner="plan")
    if parallel and planner == "portable":
        raise ValueError(
            "plan: parallel=True is a form of the native planner; the portable planner has "
            "none (use planner='native' or 'auto')"
        )
    params = dict(config=config, cap=cap, parallel=parallel, planner=planner, batch_dims=0)
    axes = varying_axes(loads)
    if planner == "portable":
        plan_ = _impl(params, "portable")(loads)
    else:
        # "auto" and "native" are resolved for each platform the computation is lowered for
        # (`_plan_lowering`): only that planner is traced and compiled. Where the mesh traced on
        # names its devices' platform (inside a shard_map), a refusal there comes now, before
        # lowering would.
        if (platform := resolve.traced_platform()) is not None:
            _planner_for(planner, parallel, platform, resolve.traced_facts().device_kind)
        plan_ = Plan(*_plan_p.bind(loads, **params))
    # Inside a shard_map the plan varies as the loads do, whichever planner made it (the FFI
    # call's outputs lose that type, the portable planner's keep it).
    return jax.tree.map(lambda a: vary(a, axes), plan_)


def _planner_for(planner: str, parallel: bool, platform: str, device_kind=None) -> str:
    """The planner ("native" or "portable") that ``planner`` is on devices of ``platform``
    (`resolve.resolve`: "native" where this install has no handler there is its one-line
    refusal, before XLA's error for an unregistered custom call); raises one line when
    ``parallel`` asks for the native planner's parallel form where the portable one runs."""
    facts = resolve.Facts(device_kind=device_kind, cuda_handler=_native.has_cuda_handler())
    chosen = resolve.resolve("planner", planner, platform, facts)
    if parallel and chosen == "portable":
        raise ValueError(
            f"plan: parallel=True is a form of the native planner, and {platform!r} plans with "
            "the portable planner (no native handler there); drop parallel=True for it"
        )
    return chosen


def _impl(params: dict, name: str):
    """The planner ``name`` ("native" or "portable") as a function of the loads [*batch, R, E],
    vmapped over ``params["batch_dims"]`` leading axes."""
    config, cap = params["config"], params["cap"]
    if name == "native":
        fn = functools.partial(_ffi_plan, config=config, cap=cap, parallel=params["parallel"])
    else:
        fn = functools.partial(_portable_plan, config=config, cap=cap)
    for _ in range(params["batch_dims"]):
        fn = jax.vmap(fn)
    return _typed_as_loads(fn)


def _typed_as_loads(fn):
    """``fn`` whose outputs vary as its loads do: the FFI call's outputs lose shard_map's type
    and the portable planner's keep it, and the branches of an export for several platforms
    (`resolve.per_platform`) must have one type."""

    def typed(loads):
        return jax.tree.map(lambda a: vary(a, varying_axes(loads)), fn(loads))

    return typed


# "auto" and "native" as one primitive whose lowering resolves the planner (`resolve.resolve`) for
# the platform it is lowered for, so that a step traced once plans natively on CPU and CUDA and
# portably on TPU and ROCm (`jax.export` for TPU of a layer on CPU devices included: the one
# choice a mesh's platform cannot make, since the native planner lowers nowhere else), and only
# that planner is traced (at lowering) and compiled. The plan is integer-valued: no derivative
# rule is needed.
_plan_p = jax.extend.core.Primitive("plan_for_platform")
_plan_p.multiple_results = True
#: The planner as a jaxpr shows it ("auto" and "native"; tests count its calls).
PLAN_PRIMITIVE = _plan_p


def _plan_shapes(loads_shape, config: BalancerConfig):
    batch = tuple(loads_shape[:-2])
    R, E, S = config.ep_size, config.num_experts, config.slots_per_rank
    return [(*batch, *shape) for shape in ((R, S), (R, S), (E,), (R,))]


def _plan_abstract_eval(loads, **params):
    return [jax.core.ShapedArray(s, jnp.int32) for s in _plan_shapes(loads.shape, params["config"])]


def _plan_lowering(ctx, loads, **params):
    platforms = ctx.module_context.platforms
    names = {p: _planner_for(params["planner"], params["parallel"], p) for p in platforms}
    _log.debug("ultraep_jax plan: planner %r lowered as %s", params["planner"], names)
    # One platform (the usual case): one planner traced; an export for several: each its own,
    # chosen when the program runs.
    impls = {p: _impl(params, name) for p, name in names.items()}
    return jax.interpreters.mlir.lower_fun(
        lambda l: list(jax.tree.leaves(resolve.per_platform(impls, l))), multiple_results=True
    )(ctx, loads)


def _plan_batch(args, dims, **params):
    (loads,), (dim,) = args, dims
    loads = jnp.moveaxis(loads, dim, 0)
    params = dict(params, batch_dims=params["batch_dims"] + 1)
    return _plan_p.bind(loads, **params), [0] * 4


@functools.cache
def _plan_jit(**params):
    return jax.jit(lambda loads: _plan_p.bind(loads, **params))


_plan_p.def_abstract_eval(_plan_abstract_eval)
_plan_p.def_impl(lambda loads, **params: _plan_jit(**params)(loads))
jax.interpreters.mlir.register_lowering(_plan_p, _plan_lowering)
jax.interpreters.batching.primitive_batchers[_plan_p] = _plan_batch


def _portable_plan(loads, config: BalancerConfig, cap: int) -> Plan:
    """The portable planner (`planning.portable`) on checked ``loads`` and a sized ``config``."""
    sizes = (config.ep_size, config.num_experts, config.slots_per_rank, config.domain_size)
    floors = (config.min_tokens_per_replica, config.master_keep_tokens, config.balance_eps, cap)
    exact, capped, values = _portable.scalar_args(*floors)
    return Plan(*_portable_jit(jnp.asarray(loads), values, *sizes, exact, capped))


# jit caches the trace, so "auto" traces the portable branch once per shape, slots, domain size,
# exact mode and whether a capacity bounds it (F, K, eps and the capacity are traced).
_portable_jit = jax.jit(_portable.portable_plan, static_argnums=tuple(range(2, 8)))


def _ffi_plan(loads, config: BalancerConfig, cap: int, parallel: bool) -> Plan:
    """The planner custom call on checked ``loads`` [R, E] and a sized ``config`` (`plan`)."""
    _native.cpu_library()  # registers the FFI targets once
    R, E, S = config.ep_size, config.num_experts, config.slots_per_rank
    i32 = jnp.int32
    out_types = (
        jax.ShapeDtypeStruct((R, S), i32),
        jax.ShapeDtypeStruct((R, S), i32),
        jax.ShapeDtypeStruct((E,), i32),
        jax.ShapeDtypeStruct((R,), i32),
        # int64 scratch for the C++ code, as int32 pairs (so it works without jax_enable_x64).
        jax.ShapeDtypeStruct((2 * _native.workspace_elems(R, E, S, parallel),), i32),
    )
    target = _native.PLAN_PARALLEL_TARGET if parallel else _native.PLAN_TARGET
    call = jax.ffi.ffi_call(target, out_types, vmap_method="broadcast_all")
    slot_expert, slot_quota, master_quota, rank_load, _ = call(
        loads,
        slots_per_rank=np.int64(S),
        min_tokens_per_replica=np.int64(config.min_tokens_per_replica),
        master_keep_tokens=np.int64(config.master_keep_tokens),
        balance_eps=np.float64(config.balance_eps),
        capacity=np.int64(cap),
        ranks_per_domain=np.int64(config.domain_size),  # the EP size when None: one domain
    )
    return Plan(slot_expert, slot_quota, master_quota, rank_load)

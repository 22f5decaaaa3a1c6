"""The experts' activations: each one's gradient inside `jax.shard_map` on a per-device input
(jax 0.12's own exact-GELU derivative fails the varying-axes check there), the exact GELU's
values and derivative against float64 closed forms, and gpt-oss's clamped unit's NaN and bounds
against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.special import erf

import ultraep_jax as uep
from tests.helpers import expert_mesh
from ultraep_jax.base.activations import ACTIVATIONS


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_gradient_inside_shard_map_equals_outside(name):
    act = ACTIVATIONS[name]
    mesh = expert_mesh(2)
    x = jnp.linspace(-5.0, 5.0, 64, dtype=jnp.float32)
    scale = jnp.float32(1.5)  # replicated: a product of varying and unvarying values
    grad_fn = jax.grad(lambda x, s: jnp.sum(act(x * s) ** 2))
    inside = jax.jit(
        jax.shard_map(grad_fn, mesh=mesh, in_specs=(P("expert"), P()), out_specs=P("expert"))
    )(
        jax.device_put(x, NamedSharding(mesh, P("expert"))),
        jax.device_put(scale, NamedSharding(mesh, P())),
    )
    np.testing.assert_allclose(
        np.asarray(inside), np.asarray(jax.jit(grad_fn)(x, scale)), rtol=1e-6
    )


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_exact_gelu_values_and_derivative_equal_closed_forms(dtype):
    x = np.linspace(-9.0, 9.0, 2001).astype(dtype)
    x64 = x.astype(np.float64)
    cdf = 0.5 * (1 + erf(x64 / np.sqrt(2)))
    pdf = np.exp(-0.5 * x64**2) / np.sqrt(2 * np.pi)
    # Compiled, as the layer runs it (op by op, each operation of the gradient compiles alone).
    value = jax.jit(ACTIVATIONS["gelu"])(jnp.asarray(x))
    slope = jax.jit(jax.vmap(jax.grad(ACTIVATIONS["gelu"])))(jnp.asarray(x))
    # Values: jax.nn.gelu's, bit for bit; both within rounding of the float64 x * Phi(x).
    gelu = jax.jit(lambda x: jax.nn.gelu(x, approximate=False))
    np.testing.assert_array_equal(np.asarray(value), np.asarray(gelu(jnp.asarray(x))))
    tol = 2e-6 if dtype == np.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(value, np.float64), x64 * cdf, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(slope, np.float64), cdf + x64 * pdf, rtol=tol, atol=tol)


def numpy_clamped_swiglu(gate, up, limit, alpha):
    """(value, d/dgate, d/dup) of gpt-oss's clamped unit in float64 NumPy, the clamp as PyTorch's
    (NaN stays NaN; an input at a bound passes the gradient, one past it none)."""
    gate, up = np.asarray(gate, np.float64), np.asarray(up, np.float64)
    with np.errstate(invalid="ignore"):
        g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
        sig = 1 / (1 + np.exp(-alpha * g))
        value = (u + 1) * g * sig
        d_gate = np.where(gate > limit, 0.0, (u + 1) * (sig + alpha * g * sig * (1 - sig)))
        d_up = np.where(np.abs(up) > limit, 0.0, g * sig)
    return value, d_gate, d_up


def test_clamped_swiglu_keeps_nan_and_passes_gradients_at_the_bounds():
    """A NaN gate or up gives NaN (it gave the clamp's value: about 14 at limit 7); a gate or up
    at a bound passes its gradient, one past it none."""
    unit = uep.ClampedSwiGLU(limit=7.0, alpha=1.702)
    nan = np.nan
    gate = np.array([nan, 1.0, nan, 7.0, 8.0, -9.0, 0.5, 0.5, 0.5, 7.0], np.float32)
    up = np.array([1.0, nan, nan, 0.3, 0.3, 0.3, 7.0, -7.0, 9.0, -8.0], np.float32)
    want, want_dg, want_du = numpy_clamped_swiglu(gate, up, unit.limit, unit.alpha)
    assert np.isnan(want[:3]).all() and not np.isnan(want[3:]).any()
    got = np.asarray(jax.jit(unit)(gate, up))
    np.testing.assert_allclose(got, want, rtol=1e-6)  # NaN where NaN, else close
    dg, du = jax.jit(jax.grad(lambda g, u: jnp.sum(unit(g, u)), argnums=(0, 1)))(gate, up)
    np.testing.assert_allclose(np.asarray(dg)[3:], want_dg[3:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(du)[3:], want_du[3:], rtol=1e-5, atol=1e-6)
    assert np.asarray(dg)[3] != 0 and np.asarray(du)[[6, 7]].all()  # the bounds pass it


@pytest.mark.parametrize("value, error", [("7", TypeError), (True, TypeError), (0.0, ValueError)])
def test_clamped_swiglu_wrong_types_are_type_errors(value, error):
    """A limit that is no number (a str, a bool) is a TypeError as elsewhere (was ValueError);
    a number out of range stays a ValueError."""
    with pytest.raises(error, match=r"^ClampedSwiGLU: limit must be a finite number > 0"):
        uep.ClampedSwiGLU(limit=value)

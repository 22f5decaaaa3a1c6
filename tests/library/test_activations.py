"""The experts' activations: each one's gradient inside `jax.shard_map` on a per-device input
(jax 0.12's own exact-GELU derivative fails the varying-axes check there), and the exact GELU's
values and derivative against float64 closed forms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy.special import erf

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

"""The hand-written pieces of the backward against `jax.vjp` of the autodiff path they
replace, in float32 and float64.

The gradients of every recurrence against the float64 loops are in tests/test_recurrences.py
and tests/test_cp.py; here each hand-written cotangent is compared with what JAX's autodiff
of the same function gives, so a wrong formula is caught where it is written.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp

from .helpers import rel_err
from .registry import FAMILIES


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _block(family, dtype, *, n=3, c=8):
    """A recurrence, a block of `n` chunks' factors, and random states and cotangents."""
    args, _ = family.make(0, b=2, t=n * c, h=2, hv=4, dk=8, dv=6, dtype=dtype)
    recurrence = family.configuration(c)
    inputs = family.inputs(*args)
    factors = _factors(recurrence, inputs, n, c)
    state = recurrence.state(inputs)
    rng = np.random.default_rng(1)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

    h = normal(n, *state.shape)
    one_h = jax.ShapeDtypeStruct(state.shape, dtype)
    out = jax.eval_shape(
        lambda f, h: recurrence.step(jax.tree.map(lambda x: x[0], f), h)[1], factors, one_h
    )
    d_next = normal(n, *state.shape)
    d_out = jax.tree.map(lambda o: normal(n, *o.shape), out)
    return recurrence, factors, h, d_next, d_out


# Each case is one compiled program (run op by op, the same arithmetic compiles ~100 small
# programs and takes several times as long).
@eqx.filter_jit
def _factors(recurrence, inputs, n: int, c: int):
    chunks = jax.tree.map(lambda x: x.reshape(x.shape[0], n, c, *x.shape[2:]), inputs)
    return recurrence.prepare(chunks)


@eqx.filter_jit
def _both_cotangents(recurrence, f, h, d_next, d_out):
    got = recurrence.factor_cotangents(f, h, d_next, d_out)
    want = dcp.AbstractRecurrence.factor_cotangents(recurrence, f, h, d_next, d_out)
    return got, want


def _cotangent_cases():
    # float32 for every family; float64 for the gated delta rule and KDA (a decay per head
    # and per channel), gated linear attention and the generalized delta rule (their own
    # hand-written cotangents; about 1 s each, one program per case), the other families'
    # float64 cases in the slow run.
    quick = ("gated_delta_rule", "kimi_delta_attention", "gla", "dplr")
    return [
        pytest.param(
            family,
            dtype,
            marks=[pytest.mark.slow] if dtype == jnp.float64 and family.name not in quick else [],
            id=f"{family.name}-{jnp.dtype(dtype).name}",
        )
        for family in FAMILIES
        for dtype in (jnp.float32, jnp.float64)
    ]


@pytest.mark.parametrize("family, dtype", _cotangent_cases())
def test_factor_cotangents_match_autodiff(family, dtype):
    # A recurrence's own `factor_cotangents` (hand-written for the built-in ones) against the
    # default, `step`'s VJP in its factors mapped over the chunks.
    with jax.enable_x64(dtype == jnp.float64):
        recurrence, f, h, d_next, d_out = _block(family, dtype)
        got, want = _both_cotangents(recurrence, f, h, d_next, d_out)
        tol = 1e-5 if dtype == jnp.float32 else 1e-12
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert rel_err(g, w) <= tol


def test_recurrences_override_factor_cotangents():
    # Every built-in recurrence writes its factors' cotangents out (no mapped `jax.vjp`).
    for family in FAMILIES:
        cls = type(family.configuration(8))
        assert cls.factor_cotangents is not dcp.AbstractRecurrence.factor_cotangents, family

"""DeltaNet (the delta rule without decay): float64 loop, gradients, CP parity.

Compilation dominates the run time, so every test of the main configuration shares one
jitted value-and-gradient function (one compilation) and its shapes.
"""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp

from .helpers import directional_check, rel_err, value_and_grad_fn, weighted_loss


CHUNK = 8  # 44 tokens: 5 full chunks + 4; on 4 ranks, 11 tokens each (1 chunk + 3)


def delta_reference(q, k, v, beta, *, scale=None, initial_state=None, l2norm=False):
    """The delta rule token by token in float64 numpy (value head j reads key head j // r)."""
    q, k, v, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, beta))
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    kh = np.repeat(k, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = np.zeros((b, hv, dk, dv)) if initial_state is None else np.array(initial_state, "f8")
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        delta = beta[:, ti][..., None] * (v[:, ti] - np.einsum("bhkv,bhk->bhv", state, kh[:, ti]))
        state = state + np.einsum("bhk,bhv->bhkv", kh[:, ti], delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


def make_inputs(seed=0, b=1, t=44, h=1, hv=2, dk=8, dv=6):
    """Random inputs (numpy-generated: no compilation), as float32 jax arrays."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    beta = rng.uniform(size=(b, t, hv))
    h0 = rng.normal(size=(b, hv, dk, dv))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, beta, h0)]


def _chunked(q, k, v, beta, h0):
    return dcp.chunk_delta_rule(
        q,
        k,
        v,
        beta,
        initial_state=h0,
        chunk_size=CHUNK,
        output_final_state=True,
        use_qk_l2norm=True,
    )


def _reference(args):
    return delta_reference(*args[:4], initial_state=args[4], l2norm=True)


single = value_and_grad_fn(_chunked, 5)


@ft.cache
def context_parallel(strategy):
    def per_rank(q, k, v, beta, h0):
        return dcp.chunk_delta_rule_cp(
            q,
            k,
            v,
            beta,
            axis_name="cp",
            strategy=strategy,
            chunk_size=CHUNK,
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm=True,
        )

    return value_and_grad_fn(per_rank, 5, cp=4)


@jax.jit
def _recurrent(q, k, v, beta, h0):
    return dcp.recurrent_delta_rule(
        q, k, v, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    # Compiling dominates these tests; XLA's optimisation passes double it and change
    # nothing here beyond rounding. Restored for the other modules.
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


def test_matches_float64_loop():
    args = make_inputs()
    expected_o, expected_h = _reference(args)
    o, h, grads = single(*args)
    assert o.shape == args[2].shape and o.dtype == jnp.float32 and h.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    o, h = _recurrent(*args)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    # Gradients vs central differences of the float64 loop, along a random direction for
    # each argument.
    errors = directional_check(grads, lambda a: weighted_loss(*_reference(a)), args)
    for name, err in zip(["q", "k", "v", "beta", "initial_state"], errors):
        assert err <= 1e-4, name


def test_options():
    args = make_inputs(1)
    fn = jax.jit(ft.partial(dcp.chunk_delta_rule, scale=0.3, chunk_size=16))
    o, none = fn(*args[:4])  # no l2norm, no initial or final state, another scale and chunk
    assert none is None
    assert rel_err(o, delta_reference(*args[:4], scale=0.3)[0]) <= 1e-5


@pytest.mark.parametrize("strategy", ["allgather", "ppermute", "ring"])
def test_context_parallel_parity(strategy):
    # Forward vs the float64 loop; backward vs the single-device kernel.
    args = make_inputs(3)
    expected_o, expected_h = _reference(args)
    _, _, expected_grads = single(*args)
    o, h, grads = context_parallel(strategy)(*args)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    for name, a, e in zip(["q", "k", "v", "beta", "initial_state"], grads, expected_grads):
        assert rel_err(a, e) <= 1e-4, name


def test_bad_input(without_runtime_typecheck):
    q, k, v, beta, h0 = make_inputs(t=10)
    with pytest.raises(ValueError, match="`beta` must have rank 3"):
        dcp.chunk_delta_rule(q, k, v, beta[..., None])
    with pytest.raises(ValueError, match="`beta` must have shape"):
        dcp.chunk_delta_rule(q, k, v, beta[:, :9])
    with pytest.raises(ValueError, match="`k` must have shape"):
        dcp.recurrent_delta_rule(q, k[..., :-1], v, beta)
    with pytest.raises(ValueError, match="multiple of the number of key heads"):
        dcp.chunk_delta_rule(*make_inputs(t=10, h=2, hv=3)[:4])
    with pytest.raises(ValueError, match="initial_state"):
        dcp.chunk_delta_rule(q, k, v, beta, initial_state=h0[..., :-1])
    with pytest.raises(ValueError, match="chunk_size"):
        dcp.chunk_delta_rule(q, k, v, beta, chunk_size=0)
    with pytest.raises(ValueError, match="load balancing must be off"):
        dcp.chunk_delta_rule_cp(q, k, v, beta, axis_name="cp", layout=dcp.Zigzag())  # pyright: ignore[reportArgumentType]

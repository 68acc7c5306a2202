"""Kimi Delta Attention: float64 loop, transformers' golden fixture, gradients, CP parity.

Compilation dominates the run time, so every test of the main configuration shares one
jitted value-and-gradient function (one compilation) and its shapes.
"""

import functools as ft
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import deltanet_cp as dcp

from .helpers import directional_check, rel_err, value_and_grad_fn, weighted_loss


DATA = pathlib.Path(__file__).parent / "data"
CHUNK = 8  # 44 tokens: 5 full chunks + 4; on 4 ranks, 11 tokens each (1 chunk + 3)


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False):
    """KDA token by token in float64 numpy: g is a log decay per key channel (B, T, HV, K)."""
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
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
        state = np.exp(g[:, ti])[..., :, None] * state  # row i scaled by exp(g[i])
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
    g = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk)))
    beta = rng.uniform(size=(b, t, hv))
    h0 = rng.normal(size=(b, hv, dk, dv))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)]


def _chunked(q, k, v, g, beta, h0):
    return dcp.chunk_kimi_delta_attention(q, k, v, g, beta, CHUNK, h0, True, True)


def _reference(args):
    return kda_reference(*args[:5], initial_state=args[5], l2norm=True)


single = value_and_grad_fn(_chunked, 6)


@pytest.fixture(autouse=True, scope="module")
def _fast_compile():
    # Compiling dominates these tests; XLA's optimisation passes double it and change
    # nothing here beyond rounding. Restored for the other modules.
    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", previous)


@ft.cache
def context_parallel(strategy):
    def per_rank(q, k, v, g, beta, h0):
        return dcp.chunk_kimi_delta_attention_cp(
            q, k, v, g, beta, CHUNK, h0, True, True, axis_name="cp", strategy=strategy
        )

    return value_and_grad_fn(per_rank, 6, cp=4)


@jax.jit
def _recurrent(q, k, v, g, beta, h0):
    return dcp.recurrent_kimi_delta_attention(q, k, v, g, beta, h0, True, True)


@jax.jit
def _chunked_plain(q, k, v, g, beta):  # no l2norm, no initial state, default scale
    return dcp.chunk_kimi_delta_attention(q, k, v, g, beta, CHUNK, output_final_state=True)


def test_matches_float64_loop():
    args = make_inputs()
    expected_o, expected_h = _reference(args)
    o, h, _ = single(*args)
    assert o.shape == args[2].shape and o.dtype == jnp.float32 and h.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    o, h = _recurrent(*args)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    o, h = _chunked_plain(*args[:5])
    expected_o, expected_h = kda_reference(*args[:5])
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    _, none = jax.eval_shape(
        lambda q, k, v, g, beta, h0: dcp.chunk_kimi_delta_attention(q, k, v, g, beta, CHUNK, h0),
        *args,
    )
    assert none is None


def test_gradients_match_float64():
    """Gradients vs central differences of the float64 loop, along a random direction for
    each argument."""
    args = make_inputs(1)
    _, _, grads = single(*args)
    errors = directional_check(grads, lambda a: weighted_loss(*_reference(a)), args)
    for name, err in zip(["q", "k", "v", "g", "beta", "initial_state"], errors):
        assert err <= 1e-4, name


def test_extreme_gates():
    # Decays that underflow float32 inside a chunk (exp(-1e4) = 0), runs without decay, and
    # channels that disagree: the intra-chunk decays must stay exact and finite.
    args = make_inputs(2)
    g = np.array(args[3])
    g[:, 3:12, :, :4] = -1e4  # half the channels forget completely
    g[:, 12:30] = 0.0  # then nothing decays for a while
    g[:, 20, :, 6] = -1e4
    g[:, 31:40, :, 4:] = -30.0
    args[3] = jnp.asarray(g)
    expected_o, expected_h = _reference(args)
    o, h, grads = single(*args)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    for grad in grads:
        assert np.all(np.isfinite(grad))
    errors = directional_check(grads, lambda a: weighted_loss(*_reference(a)), args)
    assert max(errors) <= 1e-4


def test_matches_transformers_fixture():
    # transformers 5.24 Kimi Linear `chunk_kimi_delta_attention`; see tests/data/torch_kda.json.
    meta = json.loads((DATA / "torch_kda.json").read_text())
    data = load_file(DATA / "torch_kda.safetensors")
    assert meta["case"] == {"B": 1, "T": 100, "H": 2, "K": 16, "V": 8}
    assert "use_qk_l2norm_in_kernel=True" in meta["call"] and "chunk_size=64" in meta["call"]
    args = [jnp.asarray(data[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")]
    fn = ft.partial(
        dcp.chunk_kimi_delta_attention,
        chunk_size=64,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    o, h = jax.jit(fn)(*args[:5], initial_state=args[5])
    assert rel_err(o, data["out"]) <= 1e-5
    assert rel_err(h, data["final_state"]) <= 1e-5
    expected_o, expected_h = _reference(args)  # and the fixture agrees with our loop
    assert rel_err(data["out"], expected_o) <= 1e-5
    assert rel_err(data["final_state"], expected_h) <= 1e-5


@pytest.mark.parametrize("strategy", ["allgather", "ppermute", "ring"])
def test_context_parallel_parity(strategy):
    # Forward vs the float64 loop; backward vs the single-device kernel.
    args = make_inputs(3)
    expected_o, expected_h = _reference(args)
    _, _, expected_grads = single(*args)
    o, h, grads = context_parallel(strategy)(*args)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    for name, a, e in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, expected_grads):
        assert rel_err(a, e) <= 1e-4, name


def test_bad_input(without_runtime_typecheck):
    q, k, v, g, beta, h0 = make_inputs(t=10)
    fn = dcp.chunk_kimi_delta_attention
    with pytest.raises(ValueError, match="`g` must have rank 4"):
        fn(q, k, v, g[..., 0], beta)
    with pytest.raises(ValueError, match="`g` must have shape"):
        fn(q, k, v, g[..., :-1], beta)
    q2, k2, v2, g2, beta2, _ = make_inputs(t=10, h=2, hv=4)
    with pytest.raises(ValueError, match="multiple of the number of key heads"):
        fn(q2, k2, v2[:, :, :3], g2[:, :, :3], beta2[:, :, :3])
    with pytest.raises(ValueError, match="initial_state"):
        fn(q, k, v, g, beta, initial_state=h0[..., :-1])
    with pytest.raises(ValueError, match="chunk_size"):
        fn(q, k, v, g, beta, chunk_size=0)
    with pytest.raises(ValueError, match="load balancing must be off"):
        dcp.chunk_kimi_delta_attention_cp(q, k, v, g, beta, axis_name="cp", layout=dcp.Zigzag())  # pyright: ignore[reportArgumentType]

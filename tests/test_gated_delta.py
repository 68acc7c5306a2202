import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp

from .helpers import gated_delta_reference, make_gdn_inputs, rel_err


def _both(chunk_size):
    return [
        pytest.param(
            ft.partial(dcp.chunk_gated_delta_rule, chunk_size=chunk_size), id=f"chunk{chunk_size}"
        )
        for chunk_size in ([chunk_size] if isinstance(chunk_size, int) else chunk_size)
    ] + [pytest.param(dcp.recurrent_gated_delta_rule, id="recurrent")]


def _pairwise(ts, chunk_sizes, rs):
    """The grid `r x chunk_size x t`, with a covering subset in the default run: every pair of
    values of two of the axes appears in some fast case; the rest of the grid is `slow`."""
    for i, t in enumerate(ts):
        for j, c in enumerate(chunk_sizes):
            for r in rs:
                fast = r == rs[(i + j) % len(rs)]
                marks = () if fast else (pytest.mark.slow,)
                yield pytest.param(t, c, r, marks=marks, id=f"{r}-{c}-{t}")


@pytest.mark.parametrize(
    "t, chunk_size, r", list(_pairwise([1, 63, 65, 200], [16, 32, 64], [1, 2, 3]))
)
def test_chunked_matches_float64_loop(getkey, t, chunk_size, r):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=1, t=t, h=2, hv=2 * r, dk=16, dv=8)
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    o, h = dcp.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=chunk_size
    )
    assert o.shape == v.shape and o.dtype == v.dtype
    assert h.shape == h0.shape and h.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5


@pytest.mark.parametrize("fn", _both([16, 64]))
@pytest.mark.parametrize(
    "use_state, l2norm",
    [(False, False), (True, True)]
    + [pytest.param(*x, marks=pytest.mark.slow) for x in [(True, False), (False, True)]],
)
@pytest.mark.parametrize("t", [1, 65, pytest.param(200, marks=pytest.mark.slow)])
def test_options_match_float64_loop(getkey, fn, use_state, l2norm, t):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=2, t=t, h=1, hv=3, dk=12, dv=20)
    h0 = h0 if use_state else None
    expected_o, expected_h = gated_delta_reference(
        q, k, v, g, beta, initial_state=h0, l2norm=l2norm, scale=0.3
    )
    o, h = fn(
        q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True, use_qk_l2norm=l2norm
    )
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    o2, none = fn(q, k, v, g, beta, scale=0.3, initial_state=h0, use_qk_l2norm=l2norm)
    assert none is None
    np.testing.assert_array_equal(o, o2)


def _loss_terms(o, h):
    # Fixed random weights, so every output element matters to the gradient.
    wo = np.cos(np.arange(o.size)).reshape(o.shape)
    wh = np.sin(np.arange(h.size)).reshape(h.shape)
    return wo, wh


@pytest.mark.parametrize("fn", _both(16))
@pytest.mark.parametrize("l2norm", [False, True])
def test_gradients_match_float64(getkey, fn, l2norm):
    """Gradients vs central differences of the float64 loop (exact up to O(eps^2))."""
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=1, t=21, h=1, hv=2, dk=4, dv=3)
    args = [q, k, v, g, beta, h0]
    o_ref, h_ref = gated_delta_reference(*args[:5], initial_state=h0, l2norm=l2norm)
    wo, wh = _loss_terms(o_ref, h_ref)

    def loss(q, k, v, g, beta, h0):
        o, h = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=l2norm)
        return jnp.sum(o * wo) + jnp.sum(h * wh)

    grads = jax.grad(loss, argnums=tuple(range(6)))(*args)

    def ref_loss(arrays):
        o, h = gated_delta_reference(*arrays[:5], initial_state=arrays[5], l2norm=l2norm)
        return np.sum(o * wo) + np.sum(h * wh)

    base = [np.asarray(a, np.float64) for a in args]
    eps = 1e-6
    for i, name in enumerate(["q", "k", "v", "g", "beta", "initial_state"]):
        numeric = np.zeros_like(base[i])
        for idx in np.ndindex(base[i].shape):
            plus = [a.copy() for a in base]
            minus = [a.copy() for a in base]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            numeric[idx] = (ref_loss(plus) - ref_loss(minus)) / (2 * eps)
        assert rel_err(grads[i], numeric) <= 1e-4, name


@pytest.mark.parametrize("fn", _both(16))
def test_extreme_gates(getkey, fn):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=1, t=70, h=1, hv=2, dk=8, dv=8)
    g = np.array(g)
    beta = np.array(beta)
    g[:, 5:20] = -1e4  # a run of full forgetting
    g[:, 20:40] = 0.0  # a run of no decay
    g[:, 41] = -1e4
    beta[:, 30:35] = 0.0
    beta[:, 35:40] = 1.0
    g, beta = jnp.asarray(g), jnp.asarray(beta)
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0, l2norm=True)

    def run(q, k, v, g, beta, h0):
        return fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)

    o, h = run(q, k, v, g, beta, h0)
    assert rel_err(o, expected_o) <= 1e-4
    assert rel_err(h, expected_h) <= 1e-4
    grads = jax.grad(lambda *a: jnp.sum(run(*a)[0]) + jnp.sum(run(*a)[1]), argnums=range(6))(
        q, k, v, g, beta, h0
    )
    for grad in grads:
        assert np.all(np.isfinite(grad))


def test_bf16_inputs(getkey):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), t=100, dtype=jnp.bfloat16)
    expected_o, _ = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    o, h = dcp.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 2e-2


def test_float64_inputs_stay_float64_with_x64(getkey):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), t=40)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, g, beta, h0)]
        o, h = dcp.chunk_gated_delta_rule(
            *args64[:5], initial_state=args64[5], output_final_state=True, chunk_size=16
        )
        assert o.dtype == jnp.float64 and h.dtype == jnp.float64
        expected_o, expected_h = gated_delta_reference(*args64[:5], initial_state=args64[5])
        assert rel_err(o, expected_o) <= 1e-12
        assert rel_err(h, expected_h) <= 1e-12
        # float32 inputs under x64 are not promoted.
        o32, h32 = dcp.chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True
        )
        assert o32.dtype == jnp.float32 and h32.dtype == jnp.float32
        assert rel_err(o32, expected_o) <= 1e-5


def test_jit(getkey):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), t=50)
    f = jax.jit(ft.partial(dcp.chunk_gated_delta_rule, output_final_state=True, chunk_size=16))
    o, h = f(q, k, v, g, beta, initial_state=h0)
    expected_o, _ = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, expected_o) <= 1e-5


@pytest.mark.parametrize("fn", _both(16))
class TestBadInput:
    @pytest.fixture(autouse=True)
    def _plain(self, without_runtime_typecheck):
        pass

    def test_value_heads_not_multiple(self, getkey, fn):
        q, k, v, g, beta, _ = make_gdn_inputs(getkey(), h=2, hv=3)
        with pytest.raises(ValueError, match="multiple of the number of key heads"):
            fn(q, k, v, g, beta)

    def test_mismatched_length(self, getkey, fn):
        q, k, v, g, beta, _ = make_gdn_inputs(getkey(), t=10)
        with pytest.raises(ValueError, match="sequence length"):
            fn(q, k, v[:, :9], g, beta)
        with pytest.raises(ValueError, match="`g` must have shape"):
            fn(q, k, v, g[:, :9], beta)

    def test_wrong_rank(self, getkey, fn):
        q, k, v, g, beta, _ = make_gdn_inputs(getkey())
        with pytest.raises(ValueError, match="`q` must have rank 4"):
            fn(q[0], k, v, g, beta)
        with pytest.raises(ValueError, match="`beta` must have rank 3"):
            fn(q, k, v, g, beta[..., None])

    def test_integer_dtype(self, getkey, fn):
        q, k, v, g, beta, _ = make_gdn_inputs(getkey())
        with pytest.raises(ValueError, match="`v` must be a floating-point array"):
            fn(q, k, v.astype(jnp.int32), g, beta)

    def test_bad_state(self, getkey, fn):
        q, k, v, g, beta, h0 = make_gdn_inputs(getkey())
        with pytest.raises(ValueError, match="initial_state"):
            fn(q, k, v, g, beta, initial_state=h0[:, :, :-1])


def test_bad_chunk_size(getkey, without_runtime_typecheck):
    q, k, v, g, beta, _ = make_gdn_inputs(getkey())
    with pytest.raises(ValueError, match="chunk_size"):
        dcp.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


def test_runtime_typecheck_also_rejects(getkey):
    q, k, v, g, beta, _ = make_gdn_inputs(getkey(), t=10)
    with pytest.raises(Exception):
        dcp.chunk_gated_delta_rule(q, k, v[:, :9], g, beta)

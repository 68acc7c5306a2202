"""`deltanet_cp.chunkops`: each building block against an independent float64 reference written
here (numpy loops or the direct formula), with extreme gates (very negative, -inf), and the
hand-written VJPs against `jax.grad` of the direct formula in float64."""

import functools as ft
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltanet_cp import chunkops

from .helpers import pairwise, rel_err


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


_EPS = float(np.finfo(np.float32).eps)

# The functions under test, each case compiled as one program: run op by op, the same
# arithmetic compiles about a hundred small programs and takes several times as long.
ops = SimpleNamespace(
    **{name: eqx.filter_jit(getattr(chunkops, name)) for name in chunkops.__all__}
)


def _grad(fn, argnums: int | tuple[int, ...] = 0):
    return eqx.filter_jit(jax.grad(fn, argnums))


@eqx.filter_jit
def _vjp(fn, args, ct):
    out, pull = jax.vjp(fn, *args)
    return out, pull(ct)


def _normal(rng, *shape, dtype=jnp.float32):
    return jnp.asarray(rng.normal(size=shape), dtype)


def _f32(x):
    """`x` rounded to float32, in float64: what the float32 inputs hold."""
    return np.asarray(x, np.float32).astype(np.float64)


def _gates(rng, *shape, extreme=False):
    """Log decays <= 0; with `extreme`, a strong decay early in the chunk (where differences
    of cumulative sums lose every later decay's accuracy), very negative and -inf ones."""
    g = -rng.exponential(0.3, size=shape)
    if extreme:
        g[..., 0, :] = -3000.0  # before every pair's segment but the first token's
        g[..., 3, :] = -60.0
        g[..., 4, :] = -np.inf
    # What float32 holds: the references see the same gates.
    return np.asarray(g, np.float32).astype(np.float64)


def _segment(g, j, i):
    """sum_{t=j+1}^{i} g_t along axis -2 of `g` in float64 (-inf stays -inf)."""
    return np.sum(g[..., j + 1 : i + 1, :], axis=-2)


# ---------------------------------------------------------------------------------------
# einsum, l2norm, chunk-major reshapes
# ---------------------------------------------------------------------------------------


def test_einsum_is_float32_exact():
    rng = np.random.default_rng(0)
    a, b = _normal(rng, 3, 16, 32), _normal(rng, 3, 32, 8)
    out = ops.einsum("bij,bjk->bik", a, b)
    expected = np.einsum("bij,bjk->bik", np.float64(a), np.float64(b))
    assert out.dtype == jnp.float32
    assert rel_err(out, expected) <= 1e-6


def test_l2norm():
    rng = np.random.default_rng(1)
    x = _normal(rng, 2, 5, 8).at[0, 0].set(0.0)
    x64 = np.float64(x)
    expected = x64 / np.sqrt(np.sum(x64 * x64, -1, keepdims=True) + 1e-6)
    out = ops.l2norm(x)
    assert out.dtype == x.dtype
    assert rel_err(out, expected) <= 1e-6
    assert np.all(np.asarray(out[0, 0]) == 0.0)
    grad = _grad(lambda x: jnp.sum(jnp.sin(ops.l2norm(x))))(x)
    assert np.all(np.isfinite(grad))


@pytest.mark.parametrize("features", [0, 1, 2])
def test_chunk_major_and_back(features):
    rng = np.random.default_rng(2)
    shape = (2, 3, 4, 5) + (6, 7)[:features]  # (B, N, C, H, *features)
    x = _normal(rng, *shape)
    out = ops.chunk_major(x, features=features)
    assert out.shape == (3, 2, 5, 4) + shape[4:]
    x_np = np.asarray(x)
    for b in range(2):
        for n in range(3):
            for c in range(4):
                for h in range(5):
                    assert np.array_equal(np.asarray(out[n, b, h, c]), x_np[b, n, c, h])
    back = ops.from_chunk_major(out, features=features)
    assert back.shape == x.shape and np.array_equal(back, x)


def test_chunk_major_rejects_too_few_axes():
    with pytest.raises(ValueError, match="features=2"):
        chunkops.chunk_major(jnp.zeros((2, 3, 4)), features=2)
    with pytest.raises(ValueError, match="features=1"):
        chunkops.from_chunk_major(jnp.zeros((2, 3)), features=1)


# ---------------------------------------------------------------------------------------
# Sums of log decays
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [5, 8, 24, 64])
@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum(n, reverse):
    rng = np.random.default_rng(3)
    # Terms of one sign over many orders of magnitude: every sum to a relative epsilon.
    x = np.asarray(-np.exp(rng.uniform(-8, 8, size=(3, n, 2))), np.float32).astype(np.float64)
    out = ops.cumsum(jnp.asarray(x, jnp.float32), 1, reverse=reverse)
    expected = np.flip(np.cumsum(np.flip(x, 1), 1), 1) if reverse else np.cumsum(x, 1)
    assert np.all(np.abs(np.asarray(out, np.float64) - expected) <= n * _EPS * np.abs(expected))


def test_cumsum_minus_inf():
    x = np.full((1, 16), -0.5)
    x[0, 5] = -np.inf
    out = np.asarray(ops.cumsum(jnp.asarray(x, jnp.float32), 1))
    assert np.array_equal(out, np.cumsum(x, 1).astype(np.float32))
    out = np.asarray(ops.cumsum(jnp.asarray(x, jnp.float32), -1, reverse=True))
    assert np.all(out[0, :6] == -np.inf) and np.all(np.isfinite(out[0, 6:]))


@pytest.mark.parametrize("c", [1, 6, 16])
@pytest.mark.parametrize("extreme", [False, True])
def test_segment_sums(c, extreme):
    rng = np.random.default_rng(4)
    g = _gates(rng, 2, 3, c, 1, extreme=extreme and c > 4)[..., 0]  # (2, 3, C)
    out = np.asarray(ops.segment_sums(jnp.asarray(g, jnp.float32)), np.float64)
    clamped = np.maximum(g, -1e4)[..., None]
    for i in range(c):
        for j in range(c):
            expected = _segment(clamped, j, i)[..., 0] if i >= j else 0.0
            # Each segment summed directly: a relative C epsilon of its own size, whatever
            # came before it in the chunk.
            assert np.all(np.abs(out[..., i, j] - expected) <= c * _EPS * np.abs(expected))
    if extreme and c > 4:  # -inf: a decay of exactly zero across it
        assert np.all(np.exp(np.float32(out[..., 4:, :4])) == 0)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("extreme", [False, True])
def test_cumulative_decays(per_channel, extreme):
    rng = np.random.default_rng(5)
    c, k = 16, 4
    g = _gates(rng, 2, c, k, extreme=extreme)
    if not per_channel:
        g = g[..., :1]
    arg = jnp.asarray(g if per_channel else g[..., 0], jnp.float32)
    into, out = ops.cumulative_decays(arg, per_channel)
    assert into.shape == out.shape == (2, c, k if per_channel else 1)
    expected_in = np.exp(np.stack([_segment(g, -1, i) for i in range(c)], -2))
    expected_out = np.exp(np.stack([_segment(g, i, c - 1) for i in range(c)], -2))
    for actual, expected in ((into, expected_in), (out, expected_out)):
        actual = np.asarray(actual, np.float64)
        assert np.all(actual <= 1.0)
        tiny = expected < 1e-30  # below float32's range: must be (nearly) zero
        assert np.all(np.abs(actual - expected) <= 1e-5 * expected + 1e-30 * tiny)
        if extreme:
            assert np.all(actual[tiny] <= 1e-30)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("extreme", [False, True])
def test_exclusive_decays(per_channel, extreme):
    # e^{G_{i-1}} = exp(sum_{t < i} g_t), the first row 1, against the direct float64 sum.
    rng = np.random.default_rng(6)
    c, k = 16, 4
    g = _gates(rng, 2, c, k, extreme=extreme)
    if not per_channel:
        g = g[..., :1]
    arg = jnp.asarray(g if per_channel else g[..., 0], jnp.float32)
    before = np.asarray(ops.exclusive_decays(arg, per_channel), np.float64)
    assert before.shape == (2, c, k if per_channel else 1)
    expected = np.exp(np.stack([np.sum(g[..., :i, :], axis=-2) for i in range(c)], -2))
    assert np.all(before[..., 0, :] == 1.0) and np.all(before <= 1.0)
    tiny = expected < 1e-30
    assert np.all(np.abs(before - expected) <= 1e-5 * expected + 1e-30 * tiny)
    # Shifted by one token from cumulative_decays' e^{G_i}.
    into, _ = ops.cumulative_decays(arg, per_channel)
    np.testing.assert_array_equal(before[..., 1:, :], np.asarray(into, np.float64)[..., :-1, :])


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("extreme", [False, True])
def test_decay_matrix(strict, extreme):
    # D_ij = exp(g_{j+1} + ... + g_i) for i >= j (i > j if strict), 0 above: the direct formula.
    rng = np.random.default_rng(7)
    c = 8
    g = _gates(rng, 2, 3, c, 1, extreme=extreme)[..., 0]  # (2, 3, C)
    arg = jnp.asarray(g, jnp.float32)
    d = np.asarray(ops.decay_matrix(arg, strict=strict), np.float64)
    assert d.shape == (2, 3, c, c)
    for i in range(c):
        for j in range(c):
            inside = i > j if strict else i >= j
            expected = np.exp(np.sum(g[..., j + 1 : i + 1], axis=-1)) if inside else 0.0
            assert np.all(np.abs(d[..., i, j] - expected) <= 1e-5 * expected + 1e-30)
    # Finite gradients everywhere, -inf gates and the masked triangle included.
    grad = _grad(lambda g: jnp.sum(ops.decay_matrix(g, strict=strict)))(arg)
    assert np.all(np.isfinite(np.asarray(grad)))


# ---------------------------------------------------------------------------------------
# Decayed Grams
# ---------------------------------------------------------------------------------------


def _gram_reference(x, y, g, strict):
    """`(P, S)`: the decayed Gram of rows `x (..., C, K)`, `y` under per-channel log decays
    `g (..., C, K)` in float64 loops, and its scale: the sum of the terms' absolute values,
    each times `1 + |exponent|` (float32 holds an exponent `L` only to an absolute `|L| eps`,
    a relative error `|L| eps` in its decay)."""
    x, y, g = (np.asarray(a, np.float64) for a in (x, y, g))
    shape = np.broadcast_shapes(x.shape[:-2], y.shape[:-2], g.shape[:-2])
    c = x.shape[-2]
    p, s = np.zeros((*shape, c, c)), np.zeros((*shape, c, c))
    for i in range(c):
        for j in range(c if not strict else i):
            if j > i:
                continue
            with np.errstate(invalid="ignore"):
                decay = np.exp(_segment(g, j, i))
            terms = x[..., i, :] * y[..., j, :] * decay
            p[..., i, j] = np.sum(terms, -1)
            weight = 1 + np.abs(np.where(decay > 0, _segment(g, j, i), 0))
            s[..., i, j] = np.sum(np.abs(terms) * weight, -1)
    return p, s


def _assert_exact(actual, reference, rtol=16 * _EPS):
    """Every entry to a relative `rtol` of its scale (see `_gram_reference`)."""
    p, s = reference
    actual = np.asarray(actual, np.float64)
    assert actual.shape == p.shape
    assert np.all(np.abs(actual - p) <= rtol * s + 1e-35), np.max(np.abs(actual - p) - rtol * s)


@pytest.mark.parametrize(
    "gate, strict, extreme, c",
    pairwise([["head", "channel", "none"], [False, True], [False, True], [6, 16]]),
)
def test_decayed_gram(gate, strict, extreme, c):
    rng = np.random.default_rng(6)
    k = 4
    x, y = _normal(rng, 2, 3, c, k), _normal(rng, 2, 3, c, k)
    g = _gates(rng, 2, 3, c, k, extreme=extreme)
    if gate == "head":
        g = np.repeat(g[..., :1], k, -1)
        arg = jnp.asarray(g[..., 0], jnp.float32)
    elif gate == "channel":
        arg = jnp.asarray(g, jnp.float32)
    else:
        g, arg = np.zeros_like(g), None
    out = ops.decayed_gram(x, y, arg, strict=strict)
    assert out.dtype == jnp.float32
    _assert_exact(out, _gram_reference(x, y, g, strict))


def test_decayed_gram_rejects_a_wrong_gate_shape():
    x = jnp.zeros((2, 8, 4))
    # Without runtime type checking, a ValueError; with it (as in this suite), its TypeError.
    with pytest.raises((ValueError, TypeError)):
        chunkops.decayed_gram(x, x, jnp.zeros((2, 8, 3)))


@pytest.mark.parametrize(
    "strict, extreme, c",
    pairwise([[False, True], [False, True], [5, 16]], cover=[(0, 2), (1, 2)]),
)
def test_decayed_grams(strict, extreme, c):
    # Two left and three right factors; batch axes that broadcast: x (2, 1), y (1, 3), g (2, 3).
    rng = np.random.default_rng(7)
    k = 4
    x, y = _normal(rng, 2, 1, c, 2, k), _normal(rng, 1, 3, c, 3, k)
    g = _gates(rng, 2, 3, c, k, extreme=extreme)
    out = ops.decayed_grams(x, y, jnp.asarray(g, jnp.float32), strict)
    assert out.shape == (2, 3, c, 2, c, 3)
    for p in range(2):
        for q in range(3):
            reference = _gram_reference(x[..., p, :], y[..., q, :], g, strict)
            _assert_exact(out[..., :, p, :, q], reference)


def _grams_direct(x, y, g, strict):
    """The decayed Grams as one formula in jax.numpy (for `jax.grad` in float64)."""
    c = x.shape[-3]
    t, i, j = np.ogrid[:c, :c, :c]
    inside = jnp.asarray((j < t) & (t <= i), g.dtype)  # (t, i, j)
    seg = jnp.einsum("...tk,tij->...ijk", g, inside)
    mask = jnp.asarray(np.tril(np.ones((c, c)), -1 if strict else 0), g.dtype)
    decay = jnp.exp(seg) * mask.reshape((1,) * (seg.ndim - 3) + (c, c, 1))
    return jnp.einsum("...ipk,...jqk,...ijk->...ipjq", x, y, decay)


@pytest.mark.parametrize("strict, c", pairwise([[False, True], [5, 16]], cover=[]))
def test_decayed_grams_vjp(strict, c):
    rng = np.random.default_rng(8)
    k = 4
    x, y = (_f32(rng.normal(size=s)) for s in [(2, 1, c, 2, k), (1, 3, c, 3, k)])
    g = _gates(rng, 2, 3, c, k, extreme=True)
    w = rng.normal(size=(2, 3, c, 2, c, 3))
    finite = np.maximum(g, -1e4)  # -inf as a decay of exactly zero, differentiable
    with jax.enable_x64(True):
        expected = _grad(
            lambda x, y, g: jnp.sum(jnp.asarray(w) * _grams_direct(x, y, g, strict)), (0, 1, 2)
        )(*(jnp.asarray(a, jnp.float64) for a in (x, y, finite)))
        expected = [np.asarray(e) for e in expected]
    args = [jnp.asarray(a, jnp.float32) for a in (x, y, g)]
    w32 = jnp.asarray(w, jnp.float32)
    grads = _grad(lambda x, y, g: jnp.sum(w32 * ops.decayed_grams(x, y, g, strict)), (0, 1, 2))(
        *args
    )
    for actual, e in zip(grads, expected):
        assert np.all(np.isfinite(np.asarray(actual)))
        assert rel_err(actual, e) <= 1e-5
    assert np.all(np.asarray(grads[2])[..., 4, :] == 0)  # a -inf gate's own gradient


# ---------------------------------------------------------------------------------------
# The WY form's inverse
# ---------------------------------------------------------------------------------------


def _strict_lower(rng, *shape, scale=0.3):
    return np.asarray(np.tril(rng.normal(size=shape) * scale, -1), np.float32).astype(np.float64)


@pytest.mark.parametrize("c", [1, 2, 5, 8, 33, 64])
def test_unit_lower_inverse(c):
    rng = np.random.default_rng(9)
    a = _strict_lower(rng, 3, 2, c, c)
    t = ops.unit_lower_inverse(jnp.asarray(a, jnp.float32))
    expected = np.linalg.inv(np.eye(c) + a)
    assert t.shape == a.shape and t.dtype == jnp.float32
    assert rel_err(t, expected) <= 1e-5
    assert np.all(np.triu(np.asarray(t), 1) == 0) and np.all(np.diagonal(t, 0, -2, -1) == 1)


def test_unit_lower_inverse_delta_rule_system():
    # The delta rule's A = tril(beta_i k_i . k_j, -1) with L2-normalised keys: T is bounded.
    rng = np.random.default_rng(10)
    c, dk = 64, 16
    k = rng.normal(size=(4, c, dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = rng.uniform(0, 1, size=(4, c, 1))
    a = np.tril((beta * k) @ np.swapaxes(k, -1, -2), -1)
    t = ops.unit_lower_inverse(jnp.asarray(a, jnp.float32))
    assert rel_err(t, np.linalg.inv(np.eye(c) + a)) <= 1e-5


@pytest.mark.parametrize("c", [5, 16])
def test_unit_lower_inverse_vjp(c):
    rng = np.random.default_rng(11)
    a, w = _strict_lower(rng, 3, c, c), rng.normal(size=(3, c, c))
    with jax.enable_x64(True):
        eye = jnp.broadcast_to(jnp.eye(c, dtype=jnp.float64), a.shape)
        expected = _grad(lambda a: jnp.sum(jnp.asarray(w) * jnp.linalg.inv(eye + jnp.tril(a, -1))))(
            jnp.asarray(a, jnp.float64)
        )
        expected = np.asarray(expected)
    w32 = jnp.asarray(w, jnp.float32)
    grad = _grad(lambda a: jnp.sum(w32 * ops.unit_lower_inverse(a)))(jnp.asarray(a, jnp.float32))
    assert np.all(np.triu(np.asarray(grad)) == 0)  # only the strict lower triangle is read
    assert rel_err(grad, expected) <= 1e-5


@pytest.mark.parametrize(
    "c, dtype",
    pairwise([[5, 16, 64], [jnp.float32, jnp.float64]], ids=[str, lambda d: d.__name__], cover=[]),
)
def test_unit_lower_solve_and_vjp(c, dtype):
    # The hand-written VJP against float64 autodiff of a dense solve: the same function by
    # another road (jnp.linalg.solve), differentiated by JAX.
    rng = np.random.default_rng(12)
    a, b = _strict_lower(rng, 2, 3, c, c), rng.normal(size=(2, 3, c, 7))
    ct = rng.normal(size=(2, 3, c, 7))
    with jax.enable_x64(True):
        eye = jnp.broadcast_to(jnp.eye(c, dtype=jnp.float64), a.shape)

        def dense(a, b):
            return jnp.linalg.solve(eye + jnp.tril(a, -1), b)

        x64, (da64, db64) = _vjp(dense, (jnp.asarray(a), jnp.asarray(b)), jnp.asarray(ct))
        args = (jnp.asarray(a, dtype), jnp.asarray(b, dtype))
        x, (da, db) = _vjp(chunkops.unit_lower_solve, args, jnp.asarray(ct, dtype))
    tol = 1e-5 if dtype == jnp.float32 else 1e-12
    assert x.dtype == dtype and da.dtype == dtype and db.dtype == dtype
    assert rel_err(x, x64) <= tol
    assert np.all(np.triu(np.asarray(da)) == 0)  # only the strict lower triangle is read
    assert rel_err(da, np.tril(da64, -1)) <= tol and rel_err(db, db64) <= tol


def test_unit_lower_solve_vjp_broadcast():
    # `a` shared by several right-hand sides (a key head's system read by its value heads).
    rng = np.random.default_rng(13)
    a, b = _strict_lower(rng, 2, 1, 8, 8), rng.normal(size=(2, 3, 8, 4))
    a32, b32 = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)

    def loss(solve, a, b):
        return jnp.sum(jnp.sin(solve(a, b)))

    def dense(a, b):
        eye = jnp.broadcast_to(jnp.eye(8, dtype=a.dtype), a.shape)
        return jnp.linalg.solve(jnp.broadcast_to(eye + jnp.tril(a, -1), b.shape[:-1] + (8,)), b)

    got = _grad(ft.partial(loss, ops.unit_lower_solve), (0, 1))(a32, b32)
    want = _grad(ft.partial(loss, dense), (0, 1))(a32, b32)
    assert got[0].shape == a.shape and got[1].shape == b.shape
    assert rel_err(got[0], np.tril(np.asarray(want[0]), -1)) <= 1e-5
    assert rel_err(got[1], want[1]) <= 1e-5

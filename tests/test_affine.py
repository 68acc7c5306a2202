import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import deltanet_cp as dcp

from .helpers import gated_delta_reference, make_gdn_inputs, rel_err, tree_allclose


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _random_map(key, batch=(3,), k=5, v=4):
    km, ku = jr.split(key)
    m = jr.normal(km, (*batch, k, k)) / np.sqrt(k)
    return dcp.AffineMap(m, jr.normal(ku, (*batch, k, v)))


def test_then_applies_self_first(getkey):
    a, b = _random_map(getkey()), _random_map(getkey())
    h = jr.normal(getkey(), (3, 5, 4))
    np.testing.assert_allclose(a.then(b)(h), b(a(h)), rtol=1e-5, atol=1e-5)
    # Not commutative: the other order is a different map.
    assert not np.allclose(b.then(a)(h), b(a(h)), atol=1e-3)


def test_associative(getkey):
    a, b, c = (_random_map(getkey()) for _ in range(3))
    assert tree_allclose(a.then(b).then(c), a.then(b.then(c)), rtol=1e-5, atol=1e-5)


def test_identity(getkey):
    a = _random_map(getkey())
    e = dcp.AffineMap.identity(5, 4, (3,))
    assert tree_allclose(e.then(a), a)
    assert tree_allclose(a.then(e), a)
    assert tree_allclose(a.identity_like(), e)
    h = jr.normal(getkey(), (3, 5, 4))
    np.testing.assert_array_equal(e(h), h)


@eqx.filter_jit
def _scans_and_fold(maps):
    """Both prefix scans of `maps` (leading axis), and the running compositions before and
    after each map by a plain sequential fold: one compiled program."""
    running = dcp.AffineMap.identity(5, 4, maps.M.shape[1:-2])
    before, after = [], []
    for i in range(maps.M.shape[0]):
        before.append(running)
        running = running.then(jax.tree.map(lambda x: x[i], maps))
        after.append(running)

    def stack(xs):
        return jax.tree.map(lambda *x: jnp.stack(x), *xs)

    scans = dcp.prefix_scan(maps), dcp.prefix_scan(maps, exclusive=True)
    return scans, stack(before), stack(after)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_prefix_scan_matches_sequential_fold(getkey, n):
    maps = _random_map(getkey(), batch=(n, 2))
    (inclusive, exclusive), before, after = _scans_and_fold(maps)
    for got, want in [(exclusive, before), (inclusive, after)]:
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused(without_runtime_typecheck):
    with pytest.raises(ValueError, match="square"):
        dcp.AffineMap(jnp.zeros((3, 4)), jnp.zeros((4, 2)))
    with pytest.raises(ValueError, match="U of shape"):
        dcp.AffineMap(jnp.zeros((4, 4)), jnp.zeros((3, 2)))


@pytest.mark.parametrize("chunk_size", [pytest.param(8, marks=pytest.mark.slow), 16])
def test_chunk_maps_reproduce_the_final_state(getkey, chunk_size):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), t=45)
    rec = dcp.GatedDeltaRule(chunk_size=chunk_size)
    n = -(-q.shape[1] // chunk_size)
    pad = n * chunk_size - q.shape[1]

    def split(x):  # (B, T, ...) -> (B, N, C, ...), zero-padded: what the engine hands `prepare`
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(x.shape[0], n, chunk_size, *x.shape[2:])

    @eqx.filter_jit
    def maps(inputs, h0):  # one compiled program
        factors = rec.prepare(jax.tree.map(split, inputs))
        dense = jax.vmap(rec.chunk_map)(factors)
        total = jax.tree.map(lambda x: x[-1], dcp.prefix_scan(dense))
        # The low-rank running composition gives the same map as the dense one.
        running = total.identity_like()
        for i in range(n):
            running = rec.compose(jax.tree.map(lambda x: x[i], factors), running)
        return total, total(h0), running

    total, final, running = maps(dcp.DeltaInputs(q, k, v, g, beta), h0)
    _, expected = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(final, expected) < 1e-5
    assert tree_allclose(running, total, rtol=1e-4, atol=1e-5)


def _random_diagonal_map(seed, batch=(3,), k=5, v=4):
    rng = np.random.default_rng(seed)  # numpy inputs and jitted checks: few compilations
    decay, u = rng.uniform(size=(*batch, k)), rng.normal(size=(*batch, k, v))
    return dcp.DiagonalAffineMap(jnp.asarray(decay, jnp.float32), jnp.asarray(u, jnp.float32))


def _as_dense(m):
    eye = jnp.eye(m.decay.shape[-1]).reshape((1,) * (m.decay.ndim - 1) + (m.decay.shape[-1],) * 2)
    return dcp.AffineMap(m.decay[..., :, None] * eye, m.U)


@jax.jit
def _monoid_checks(a, b, c, h):
    e = a.identity_like()
    return dict(
        then=(a.then(b)(h), b(a(h)), b.then(a)(h)),
        assoc=(a.then(b).then(c), a.then(b.then(c))),
        identity=(e.then(a), a.then(e), e(h)),
        dense=(_as_dense(a.then(b)), _as_dense(a).then(_as_dense(b))),
    )


def test_diagonal_map_is_a_monoid():
    a, b, c = (_random_diagonal_map(i) for i in range(3))
    h = jnp.asarray(np.random.default_rng(3).normal(size=(3, 5, 4)), jnp.float32)
    out = _monoid_checks(a, b, c, h)
    ab_h, b_a_h, ba_h = out["then"]
    np.testing.assert_allclose(ab_h, b_a_h, rtol=1e-5, atol=1e-5)  # `a` is applied first
    assert not np.allclose(ba_h, b_a_h, atol=1e-3)
    assert tree_allclose(*out["assoc"], rtol=1e-5, atol=1e-5)
    ea, ae, eh = out["identity"]
    assert tree_allclose(ea, a) and tree_allclose(ae, a)
    np.testing.assert_array_equal(eh, h)
    assert tree_allclose(a.identity_like(), dcp.DiagonalAffineMap.identity(5, 4, (3,)))
    # The same map as the dense one with M = diag(decay).
    assert tree_allclose(*out["dense"], atol=1e-6)


def test_diagonal_prefix_scan_matches_sequential_fold():
    n = 5
    maps = _random_diagonal_map(4, batch=(n, 2))
    inclusive = jax.jit(dcp.prefix_scan)(maps)
    exclusive = jax.jit(lambda m: dcp.prefix_scan(m, exclusive=True))(maps)
    decay, u = np.ones((2, 5)), np.zeros((2, 5, 4))  # the fold, in float64 numpy
    for i in range(n):
        np.testing.assert_allclose(exclusive.decay[i], decay, rtol=1e-5)
        np.testing.assert_allclose(exclusive.U[i], u, rtol=1e-5, atol=1e-6)
        d_i, u_i = np.asarray(maps.decay[i], np.float64), np.asarray(maps.U[i], np.float64)
        decay, u = d_i * decay, d_i[..., None] * u + u_i
        np.testing.assert_allclose(inclusive.decay[i], decay, rtol=1e-5)
        np.testing.assert_allclose(inclusive.U[i], u, rtol=1e-5, atol=1e-6)


def test_diagonal_bad_shapes_are_refused(without_runtime_typecheck):
    with pytest.raises(ValueError, match="decay of shape"):
        dcp.DiagonalAffineMap(jnp.ones((3,)), jnp.zeros((4, 2)))

"""`deltanet_cp.previous_tokens`: each token's predecessor, against a NumPy loop, on one
device, with packed documents, and under context parallelism in both layouts (one
compiled program per layout and number of ranks)."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import deltanet_cp as dcp


T = 24
CU = np.array([0, 5, 5, 13, 24], np.int32)  # an empty document, boundaries off the pieces


def _reference(x, cu=None, initial=None):
    """The token before each token in NumPy (zeros at a later document's first token)."""
    y = np.zeros_like(x)
    y[:, 0] = 0 if initial is None else initial
    y[:, 1:] = x[:, :-1]
    if cu is not None:
        for start in cu[1:-1]:
            if start < x.shape[1]:
                y[:, start] = 0
    return y


def _inputs(b=2):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(b, T, 3, 2)).astype(np.float32)
    return x, rng.normal(size=(b, 3, 2)).astype(np.float32)


def test_one_device_and_packed_documents():
    x, initial = _inputs()
    np.testing.assert_array_equal(dcp.previous_tokens(jnp.asarray(x)), _reference(x))
    got = dcp.previous_tokens(jnp.asarray(x), initial=jnp.asarray(initial))
    np.testing.assert_array_equal(got, _reference(x, initial=initial))
    got = dcp.previous_tokens(jnp.asarray(x[:1]), cu_seqlens=jnp.asarray(CU))
    np.testing.assert_array_equal(got, _reference(x[:1], CU))
    # As a list, as `run` and the public functions take it.
    got = dcp.previous_tokens(jnp.asarray(x[:1]), cu_seqlens=[int(c) for c in CU])
    np.testing.assert_array_equal(got, _reference(x[:1], CU))
    # A NaN reaches only the token after it.
    bad = x.copy()
    bad[0, 7] = np.nan
    got = np.asarray(dcp.previous_tokens(jnp.asarray(bad)))
    assert np.isnan(got[0, 8]).all() and np.isfinite(np.delete(got[0], 8, axis=0)).all()


@ft.cache
def _sharded(cp: int, layout: dcp.AbstractLayout, packed: bool):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(AxisType.Auto,))
    context = dcp.ContextParallel("cp", layout=layout)
    cu = jnp.asarray(CU) if packed else None

    def local(x, initial):
        return dcp.previous_tokens(x, cp=context, cu_seqlens=cu, initial=initial)

    return jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P(None, "cp"), P()), out_specs=P(None, "cp"))
    )


# About 1 s each (one small program).
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", [dcp.Contiguous(), dcp.Zigzag()], ids=["Contiguous", "Zigzag"])
def test_context_parallel(cp, layout):
    x, initial = _inputs(b=1)
    for packed in (False, True):
        fn = _sharded(cp, layout, packed)
        got = fn(layout.to_layout(jnp.asarray(x), cp), jnp.asarray(initial))
        want = _reference(x, CU if packed else None, initial)
        np.testing.assert_array_equal(layout.from_layout(got, cp), want)


def test_errors(without_runtime_typecheck):
    # The messages a user gets (the suite's runtime shape checks off).
    with pytest.raises(ValueError, match=r"\(batch, seq, \.\.\.\)"):
        dcp.previous_tokens(jnp.ones(3))
    with pytest.raises(ValueError, match="`initial` must be"):
        dcp.previous_tokens(jnp.ones((1, 4, 2)), initial=jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="one batch row"):
        dcp.previous_tokens(jnp.ones((2, 4)), cu_seqlens=jnp.asarray([0, 2, 4]))
    # `cu_seqlens` checked as `run` checks it: ints, ending at the sequence's length.
    with pytest.raises(ValueError, match="must hold ints"):
        dcp.previous_tokens(jnp.ones((1, 4)), cu_seqlens=[0, 2.5, 4])  # pyright: ignore
    with pytest.raises(Exception, match="cu_seqlens"):
        dcp.previous_tokens(jnp.ones((1, 4)), cu_seqlens=[0, 2, 5])
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="without `mesh`"):
        dcp.previous_tokens(jnp.ones((1, 4)), cp=dcp.ContextParallel("cp", mesh=mesh))

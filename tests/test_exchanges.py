"""Exchanges: the interface is the collective alone, so an exchange of your own (a naive
all-gather written here) runs the families end to end against the float64 loops; the cost
model lives on the built-in exchanges."""

import jax
import jax.numpy as jnp
import pytest

import deltanet_cp as dcp

from .helpers import assert_cp_matches_loop, rel_err
from .registry import FAMILIES, Family


class NaiveAllGather(dcp.AbstractExchange):
    """Every rank gathers every map and applies them one by one, in walk order."""

    def __call__(self, local, h0, *, axis_name, reverse=False):
        maps = jax.tree.map(lambda x: jax.lax.all_gather(x, axis_name, to="invarying"), local)
        cp = jax.lax.axis_size(axis_name)
        entering = [h0] * cp
        h = h0
        for r in reversed(range(cp)) if reverse else range(cp):
            entering[r] = h
            h = jax.tree.map(lambda x: x[r], maps)(h)
        return jnp.stack(entering)[jax.lax.axis_index(axis_name)], h


CHUNK = 8
SHAPE = dict(b=1, t=48, h=1, hv=2, dk=8, dv=6)


def _mesh(cp: int):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _reference(family: Family, args, h0):
    return family.reference(*args, initial_state=h0, l2norm=family.l2norm)


def test_the_interface_is_the_collective():
    assert dcp.AbstractExchange.__abstractmethods__ == frozenset({"__call__"})
    assert not hasattr(dcp.AbstractExchange, "payload_elements")
    for ex in (dcp.AllGather(), dcp.PPermute(), dcp.Ring()):
        assert isinstance(ex, dcp.AbstractCostedExchange)
    assert not isinstance(dcp.Auto(), dcp.AbstractCostedExchange)
    assert not isinstance(NaiveAllGather(), dcp.AbstractCostedExchange)
    cp = dcp.ContextParallel("cp", exchange=NaiveAllGather())
    assert cp.exchange == NaiveAllGather()


@pytest.mark.parametrize(
    "family, layout, cp",
    [
        pytest.param(
            f,
            layout,
            cp,
            id=f"{f.name}-{type(layout).__name__.lower()}-cp{cp}",
            marks=() if i % 2 == j else (pytest.mark.slow,),
        )
        for i, f in enumerate(FAMILIES)
        for j, (layout, cp) in enumerate([(dcp.Contiguous(), 4), (dcp.Zigzag(), 2)])
    ],
)
def test_own_exchange_matches_loop(family, layout, cp, fast_compile):
    # Forward, final state and gradients (the backward walks the ranks the other way with
    # the same exchange) against the float64 loop.
    args, h0 = family.make(9, **SHAPE)
    parallel = dcp.ContextParallel("cp", layout=layout, exchange=NaiveAllGather(), mesh=_mesh(cp))
    kw: dict = dict(chunk_size=CHUNK)
    if family.l2norm:
        kw["use_qk_l2norm"] = True

    assert_cp_matches_loop(family, parallel, args, h0, **kw)


def test_own_exchange_with_packed_documents(fast_compile):
    # Documents crossing ranks and pieces: the maps carry their resets through the exchange.
    family = FAMILIES[0]
    args, _ = family.make(4, **SHAPE)
    cu = [0, 5, 20, 20, 48]
    parallel = dcp.ContextParallel(
        "cp", layout=dcp.Zigzag(), exchange=NaiveAllGather(), mesh=_mesh(2)
    )
    kw: dict = dict(chunk_size=CHUNK)
    if family.l2norm:
        kw["use_qk_l2norm"] = True
    o, h = jax.jit(lambda a: family.chunk(*a, cu_seqlens=cu, cp=parallel, **kw))(list(args))
    expected_o, expected_h = family.reference(*args, cu_seqlens=cu, l2norm=family.l2norm)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5

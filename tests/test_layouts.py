"""Layouts: everything follows from `held`, a layout of your own runs every family against the
float64 loops, and `run` reaches the typed engine (`run_contiguous`) once per walk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
import deltanet_cp._run as engine_module

from .helpers import assert_cp_matches_loop, rel_err
from .registry import FAMILIES, Family, GATED_DELTA_RULE


class Reversed(dcp.AbstractLayout):
    """Rank `r` holds piece `cp - 1 - r`: one walk, in reverse rank order."""

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((cp - 1 - r,) for r in range(cp))


class ThreeWalks(dcp.AbstractLayout):
    """Rank `r` holds pieces `r`, `2 cp - 1 - r` and `2 cp + r`: forwards, back, forwards."""

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((r, 2 * cp - 1 - r, 2 * cp + r) for r in range(cp))


class OutOfOrder(dcp.AbstractLayout):
    """Contiguous runs, but the first walk is the second half of the sequence."""

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((cp + r, r) for r in range(cp))


class Uneven(dcp.AbstractLayout):
    """Rank 0 holds two pieces, the others one."""

    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return ((0, cp),) + tuple((r,) for r in range(1, cp))


CHUNK = 8
# 48 tokens: 12 pieces of 4 under ThreeWalks at cp = 4, 4 pieces of 12 under Reversed.
SHAPE = dict(b=1, t=48, h=1, hv=2, dk=8, dv=6)


def _mesh(cp: int):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _options(family: Family) -> dict:
    kw: dict = dict(chunk_size=CHUNK)
    if family.l2norm:
        kw["use_qk_l2norm"] = True
    return kw


def _reference(family: Family, args, h0):
    return family.reference(*args, initial_state=h0, l2norm=family.l2norm)


def test_everything_follows_from_held():
    three = ThreeWalks()
    assert three.pieces(2) == 6
    assert three.directions(2) == (False, True, False)
    walks = three.walks(6, 2)
    assert [(w.local, w.start, w.reverse) for w in walks] == [
        (slice(0, 2), 0, False),
        (slice(2, 4), 4, True),
        (slice(4, 6), 8, False),
    ]
    assert [w.ranks(2) for w in walks] == [(0, 1), (1, 0), (0, 1)]
    # The positions, the reordering and the built-in layouts agree with `held`.
    table = three.position_table(6, 2)
    assert table.tolist() == [[0, 1, 6, 7, 8, 9], [2, 3, 4, 5, 10, 11]]
    x = jnp.arange(12)[None]
    ordered = three.to_layout(x, 2)
    assert ordered[0].tolist() == table.reshape(-1).tolist()
    assert (three.from_layout(ordered, 2) == x).all()
    assert dcp.Zigzag().directions(4) == (False, True)
    assert dcp.Contiguous().directions(4) == (False,)
    assert (dcp.Zigzag().to_layout(x, 3) == dcp.to_zigzag(x, 3)).all()
    assert Reversed().walks(8, 4) == (dcp.internal.Walk(slice(0, 8), 0, True),)


def test_bad_layouts_refused():
    with pytest.raises(ValueError, match=r"piece 0 of the shards must be pieces 0 \.\. 1"):
        OutOfOrder().walks(4, 2)
    with pytest.raises(ValueError, match="the same number of pieces"):
        Uneven().directions(3)
    # With a mesh the number of ranks is known: refused when the ContextParallel is built.
    with pytest.raises(ValueError, match="one contiguous run in rank order"):
        dcp.ContextParallel("cp", layout=OutOfOrder(), mesh=_mesh(2))
    with pytest.raises(ValueError, match="must be divisible by the number of pieces, 12"):
        ThreeWalks().to_layout(jnp.zeros((1, 30)), 4)


def _user_layout_params():
    layouts = [(Reversed(), "ring"), (ThreeWalks(), "allgather"), (ThreeWalks(), "ppermute")]
    # Default run: the first four families, each user layout at least once. The slow run
    # gives every family one more layout, the next in turn, so that every layout meets
    # every family's arguments in a third of the families or more: the reordering and the
    # walks are one code path for every recurrence (the whole product, 33 cases, cost
    # three times the slow run's 11).
    n = len(layouts)
    return [
        pytest.param(
            f,
            layout,
            exchange,
            id=f"{f.name}-{type(layout).__name__}-{exchange}",
            marks=() if i % n == j and i < 4 else (pytest.mark.slow,),
        )
        for i, f in enumerate(FAMILIES)
        for j, (layout, exchange) in enumerate(layouts)
        if (i % n == j and i < 4) or (i + 1) % n == j
    ]


@pytest.mark.parametrize("family, layout, exchange", _user_layout_params())
def test_user_layout_matches_loop(family, layout, exchange, fast_compile):
    # Global arrays in sequence order: `run` reorders them for the layout, walks its three
    # walks (or its one reversed walk) and puts the outputs back in sequence order.
    cp = 4
    args, h0 = family.make(5, **SHAPE)
    parallel = dcp.ContextParallel("cp", layout=layout, exchange=exchange, mesh=_mesh(cp))
    kw = _options(family)

    assert_cp_matches_loop(family, parallel, args, h0, **kw)


def test_user_layout_inside_shard_map(fast_compile):
    # This rank's shard in the layout's order; the outputs come back in it.
    cp, layout = 2, ThreeWalks()
    family = GATED_DELTA_RULE
    args, h0 = family.make(8, **SHAPE)
    mesh = _mesh(cp)
    seq = P(None, "cp")

    def per_rank(args, h0):
        parallel = dcp.ContextParallel("cp", layout=layout, exchange="ring")
        o, h = family.chunk(*args, initial_state=h0, cp=parallel, **_options(family))
        return o, h, layout.positions(o.shape[1], "cp")

    fn = jax.jit(
        jax.shard_map(
            per_rank, mesh=mesh, in_specs=((seq,) * len(args), P()), out_specs=(seq, P(), P("cp"))
        )
    )
    placed = jax.device_put(tuple(layout.to_layout(x, cp) for x in args), NamedSharding(mesh, seq))
    o, h, positions = fn(placed, h0)
    expected_o, expected_h = _reference(family, args, h0)
    np.testing.assert_array_equal(np.asarray(positions), layout.position_table(24, cp).reshape(-1))
    assert rel_err(layout.from_layout(o, cp), expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5


@pytest.mark.parametrize(
    "layout, walks",
    [(None, 1), (dcp.Contiguous(), 1), (dcp.Zigzag(), 2), (Reversed(), 1), (ThreeWalks(), 3)],
    ids=lambda x: type(x).__name__ if not isinstance(x, int) else str(x),
)
@pytest.mark.parametrize("packed", [False, True], ids=["whole", "packed"])
def test_run_hands_the_typed_engine_every_walk(layout, walks, packed, monkeypatch):
    # Every call of `run` reaches the typed engine with a `ContextParallel[Contiguous]`
    # without a mesh (the walks' own) and the layout's walks in chain order: all of them in
    # one pass (stacked on the batch axis), or, with packed documents (whose chunks differ
    # from walk to walk), one pass per walk.
    calls = []
    engine = engine_module._run

    def counted(recurrence, inputs, *args, cp=None, walks=(), **kw):
        calls.append((cp, tuple(w.reverse for w in walks), inputs.q.shape[0]))
        return engine(recurrence, inputs, *args, cp=cp, walks=walks, **kw)

    monkeypatch.setattr(engine_module, "_run", counted)
    family = GATED_DELTA_RULE
    # Shapes no other test compiles for (`run` under a mesh is compiled once per shapes).
    args, h0 = family.make(2, b=1, t=24, h=1, hv=1, dk=4, dv=4)
    rule = family.configuration(CHUNK)
    cu = [0, 5, 24] if packed else None
    h0 = jnp.stack([h0[0], h0[0]]) if packed else h0
    if layout is None:
        dcp.run(rule, family.inputs(*args), initial_state=h0, cu_seqlens=cu)
        assert calls == [(None, (False,), 1)]
        return
    cp = dcp.ContextParallel("cp", layout=layout, mesh=_mesh(2))
    dcp.run(rule, family.inputs(*args), initial_state=h0, cu_seqlens=cu, cp=cp)
    directions = layout.directions(2)
    if packed or walks == 1:
        assert [c[1:] for c in calls] == [((d,), 1) for d in directions]
    else:
        assert [c[1:] for c in calls] == [(directions, walks)]
    assert all(c[0] == dcp.ContextParallel("cp") for c in calls)

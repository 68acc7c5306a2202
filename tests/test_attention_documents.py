"""Packed documents in blockwise attention: each query sees the keys of its own document
only, at or before it, against a float64 reference that runs each document's causal softmax
attention alone; on one device and on 4 ranks (both layouts, both key/value schedules),
documents crossing rank boundaries, several per rank, one spanning every rank. The tiles
the documents leave without a visible pair are not in the loop; a NaN stays in its
document."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn._context import documents, local_positions
from deltanet_cp.nn._flash import blockwise_attention, document_tiles, to_blocks
from deltanet_cp.nn._schedule import tile_loops, tiling

from .helpers import rel_err


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

T, HEADS, KV_HEADS, DIM, TILE, CP = 64, 4, 2, 8, 4, 4
# Same shape (one compiled program each): 7 documents. A: one document from rank 0 to
# rank 3 (both layouts), three short ones on the first rank, an empty one at the end. B:
# boundaries off the tiles and across ranks. Rank pieces: 16 tokens (Contiguous), 8 (Zigzag).
CU_SEQLENS = {
    "spanning": [0, 3, 5, 6, 58, 61, 64, 64],
    "crossing": [0, 7, 13, 16, 17, 30, 45, 64],
}
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}
CASES = [pytest.param(None, None, None, id="one_device")] + [
    pytest.param(CP, name, kv, id=f"cp{CP}-{name}-{kv}")
    for name in LAYOUTS
    for kv in ("allgather", "ring")
]


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(T, h, DIM)) for h in (HEADS, KV_HEADS, KV_HEADS))
    w = np.cos(np.arange(T * HEADS * DIM)).reshape(T, HEADS, DIM)
    return [jnp.asarray(a, jnp.float32) for a in (q, k, v, w)]


def _reference_out(q, k, v, cu, xp):
    """Each document's causal softmax attention alone (queries scaled by dim^-1/2), query
    head `h` reading key head `h // group`, in `xp` (numpy or jax.numpy)."""
    group = HEADS // KV_HEADS
    outs = []
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        kd, vd = xp.repeat(k[a:b], group, axis=1), xp.repeat(v[a:b], group, axis=1)
        s = xp.einsum("qhd,khd->hqk", q[a:b], kd) / np.sqrt(DIM)
        s = xp.where(np.tril(np.ones((b - a, b - a), bool))[None], s, -np.inf)
        p = xp.exp(s - xp.max(s, axis=-1, keepdims=True))
        p = p / xp.sum(p, axis=-1, keepdims=True)
        outs.append(xp.einsum("hqk,khd->qhd", p, vd))
    return xp.concatenate(outs, axis=0)


def _loss(out, w, xp):
    return xp.sum(xp.sin(out) * w)  # its cotangent is NaN wherever an output is


@ft.cache
def _reference(name: str):
    """Float64 outputs and gradients of the per-document reference."""
    cu = CU_SEQLENS[name]
    q, k, v, w = (np.asarray(a, np.float64) for a in _inputs())
    out = _reference_out(q, k, v, cu, np)
    with jax.enable_x64(True):

        def loss(q, k, v):
            return _loss(_reference_out(q, k, v, cu, jnp), jnp.asarray(w), jnp)

        args = [jnp.asarray(a, jnp.float64) for a in (q, k, v)]
        grads = jax.grad(loss, argnums=(0, 1, 2))(*args)
        return out, [np.asarray(g) for g in grads]


@ft.cache
def _attention_fn(cp: int | None, layout_name: str | None, kv_schedule: str | None):
    """Jitted `(q, k, v, w, cu) -> (out, grads of the sin loss w.r.t. q, k, v)`, global
    arrays in sequence order, `cu` traced."""

    def attend(q, k, v, cu, ctx):
        docs = documents(ctx, q.shape[0], cu)
        out, _ = blockwise_attention(
            q,
            k,
            v,
            local_positions(ctx, q.shape[0]),
            cp=ctx,
            kv_schedule=kv_schedule or "allgather",
            tile_size=TILE,
            cu_seqlens=docs.cu_seqlens,
        )
        return out

    if cp is None:
        run = ft.partial(attend, ctx=None)
    else:
        layout = LAYOUTS[str(layout_name)]
        auto = (jax.sharding.AxisType.Auto,)  # the global arrays are laid out inside `jit`
        mesh = jax.make_mesh((cp,), ("cp",), axis_types=auto, devices=jax.devices()[:cp])
        ctx = dcp.ContextParallel("cp", layout=layout)
        seq = P("cp")
        local = jax.shard_map(
            ft.partial(attend, ctx=ctx), mesh=mesh, in_specs=(seq, seq, seq, P()), out_specs=seq
        )

        def run(q, k, v, cu):
            q, k, v = (layout.to_layout(a, cp, axis=0) for a in (q, k, v))
            return layout.from_layout(local(q, k, v, cu), cp, axis=0)

    @jax.jit
    def fn(q, k, v, w, cu):
        out, vjp = jax.vjp(lambda q, k, v: run(q, k, v, cu), q, k, v)
        return out, vjp(jnp.cos(out) * w)

    return fn


@pytest.mark.parametrize("cp, layout, kv_schedule", CASES)
def test_documents_against_float64(cp, layout, kv_schedule):
    fn = _attention_fn(cp, layout, kv_schedule)
    q, k, v, w = _inputs()
    for name, cu in CU_SEQLENS.items():
        out, grads = fn(q, k, v, w, jnp.asarray(cu, jnp.int32))
        expected_out, expected_grads = _reference(name)
        assert rel_err(out, expected_out) <= 1e-5, name
        errors = [rel_err(g, e) for g, e in zip(grads, expected_grads)]
        assert max(errors) <= 1e-5, (name, errors)


@pytest.mark.parametrize(
    "cp, layout, kv_schedule",
    [CASES[0], pytest.param(CP, "zigzag", "ring", id=f"cp{CP}-zigzag-ring")],
)
def test_nan_stays_in_its_document(cp, layout, kv_schedule):
    # A NaN value in document 5 (tokens 30 .. 44, on two ranks): every other document's
    # outputs and gradients are the clean run's, though the loss's cotangents are NaN on
    # document 5's outputs from the NaN on; so are the outputs of its earlier tokens.
    fn = _attention_fn(cp, layout, kv_schedule)
    q, k, v, w = _inputs()
    cu = jnp.asarray(CU_SEQLENS["crossing"], jnp.int32)
    clean_out, clean_grads = fn(q, k, v, w, cu)
    out, grads = fn(q, k, v.at[38, 1, 2].set(jnp.nan), w, cu)
    clean = np.r_[0:38, 45:T]
    assert np.array_equal(np.asarray(out)[clean], np.asarray(clean_out)[clean])
    others = np.r_[0:30, 45:T]
    for g, c in zip(grads, clean_grads):
        assert np.array_equal(np.asarray(g)[others], np.asarray(c)[others])
    assert not np.any(np.isfinite(np.asarray(out)[38:45, 2:]))  # key head 1's queries


def _visible_tiles(pos_q, starts, pos_k, bq: int, bk: int) -> set[tuple[int, int]]:
    """The (query block, key block) tiles holding a visible pair, in numpy."""
    vis = (pos_k[None, :] <= pos_q[:, None]) & (pos_k[None, :] >= starts[:, None])
    nq, nk = len(pos_q) // bq, len(pos_k) // bk
    return {
        (i, j)
        for i in range(nq)
        for j in range(nk)
        if vis[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk].any()
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(CU_SEQLENS))
def test_skipped_tiles_are_exactly_the_empty_ones(layout, name):
    # The loop over tiles runs `count` tiles: exactly those with a visible pair under the
    # document mask, on every rank of the all-gather's schedule (one device: cp = 1).
    cu = np.asarray(CU_SEQLENS[name])
    for cp in (1, CP):
        t = T // cp
        b, m = tiling(LAYOUTS[layout], t, cp, TILE)
        table = LAYOUTS[layout].position_table(t, cp)
        (schedule,) = tile_loops(LAYOUTS[layout].held(cp), m, "allgather")[0]
        pos_k = table.reshape(-1)
        for r in range(cp):
            pos_q = table[r]
            starts = cu[np.searchsorted(cu, pos_q, side="right") - 1]
            tiles, row, count = document_tiles(
                schedule.at(r), to_blocks(jnp.asarray(starts), b), to_blocks(jnp.asarray(pos_k), b)
            )
            kept = {tuple(int(x) for x in ij) for ij in np.asarray(tiles)[int(row), : int(count)]}
            assert kept == _visible_tiles(pos_q, starts, pos_k, b, b), (cp, r)


def test_document_positions():
    # Per rank, in either layout: each token's document and its position in it (the
    # rotary positions), against numpy on the global positions.
    cu = CU_SEQLENS["spanning"]
    auto = (jax.sharding.AxisType.Auto,)
    mesh = jax.make_mesh((CP,), ("cp",), axis_types=auto, devices=jax.devices()[:CP])
    for layout in LAYOUTS.values():
        ctx = dcp.ContextParallel("cp", layout=layout)

        def local(x, ctx=ctx):
            docs = documents(ctx, x.shape[0], cu)
            return docs.ids, docs.positions

        f = jax.shard_map(local, mesh=mesh, in_specs=P("cp"), out_specs=(P("cp"), P("cp")))
        ids, positions = jax.jit(f)(jnp.zeros((T,)))
        pos = layout.position_table(T // CP, CP).reshape(-1)
        want = np.searchsorted(cu, pos, side="right") - 1
        assert np.array_equal(ids, want)
        assert np.array_equal(positions, pos - np.asarray(cu)[want])
        docs = documents(None, T, cu)
        assert np.array_equal(docs.positions, np.arange(T) - np.asarray(cu)[docs.ids])


def test_bad_cu_seqlens():
    # Values through `eqx.error_if` (under `jit` too; eagerly an `EquinoxRuntimeError`).
    with pytest.raises((ValueError, RuntimeError), match="must start at 0"):
        documents(None, T, [0, 5, 60])
    with pytest.raises(ValueError, match="must hold ints"):
        documents(None, T, [0, 5.0, 64])

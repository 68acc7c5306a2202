"""Non-finite inputs stay where the float64 loop keeps them: in their own document, and,
for an input that reaches only the outputs (a query), in their own token's outputs.

A document start forgets the state entering it exactly (a select, not a multiplication by
a zero linear part, since `0 * nan` is `nan`) wherever maps are composed, applied or
transposed: on one device, under every exchange and layout, forward and backward.
"""

import functools as ft

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp.nn._flash import blockwise_attention

from .helpers import pairwise, rel_err
from .registry import exchange_id, EXCHANGES, FAMILIES, Family, GATED_DELTA_RULE, GLA


CHUNK = 4
CU = (0, 6, 16)  # document 0: tokens 0-5; document 1: tokens 6-15
DOCS = [(0, 6), (6, 16)]
SHAPE = dict(b=1, t=16, h=1, hv=2, dk=4, dv=3)
LAYOUTS = [dcp.Contiguous(), dcp.Zigzag()]


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _options(family: Family) -> dict:
    return dict(use_qk_l2norm=True) if family.l2norm else {}


def _weights(shape, f):
    return f(np.arange(int(np.prod(shape)), dtype=np.float64)).reshape(shape)


def _loss_terms(o, finals, xp):
    """A loss whose cotangents are NaN wherever an output or final state is (`sin`)."""
    wo = xp.asarray(_weights(o.shape, np.cos), o.dtype)
    wh = xp.asarray(_weights(finals.shape, np.sin), finals.dtype)
    return xp.sin(o) * wo, xp.sin(finals) * wh


@ft.cache
def _packed_grad_fn(family: Family, cp: int | None, layout, exchange):
    """Jitted `(args, h0s) -> (o, finals, grads w.r.t. args and h0s)` of the `sin` loss over
    every output and final state, on one device or on a `cp`-device mesh (global arrays)."""
    ctx = None
    if cp is not None:
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        ctx = dcp.ContextParallel("cp", layout=layout, exchange=exchange, mesh=mesh)

    def loss(args, h0s):
        o, finals = family.chunk(
            *args,
            initial_state=h0s,
            cu_seqlens=list(CU),
            chunk_size=CHUNK,
            cp=ctx,
            **_options(family),
        )
        lo, lh = _loss_terms(o, finals, jnp)
        return jnp.sum(lo) + jnp.sum(lh), (o, finals)

    @jax.jit
    def fn(args, h0s):
        (_, (o, finals)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(args, h0s)
        return o, finals, grads

    return fn


def _inputs(family: Family, seed: int):
    args, _ = family.make(seed, **SHAPE)
    rng = np.random.default_rng(seed)
    b, hv, dk, dv = SHAPE["b"], SHAPE["hv"], SHAPE["dk"], SHAPE["dv"]
    h0s = jnp.asarray(
        0.5 * rng.normal(size=(len(DOCS) * b, hv, family.state_rows * dk, dv)), jnp.float32
    )
    return list(args), h0s


def _with(args, n: int, token: int, value=np.nan):
    x = np.array(args[n])
    x[:, token] = value
    return [*args[:n], jnp.asarray(x), *args[n + 1 :]]


def _check_document_is_clean(family: Family, args, h0s, doc: int, out):
    """Document `doc`'s outputs, final state and input gradients are finite and the float64
    loop's (its gradients by central differences of the loop's loss on that document)."""
    o, finals, (grads, d_h0s) = out
    a, b = DOCS[doc]
    ref = ft.partial(family.reference, l2norm=family.l2norm, cu_seqlens=CU)
    expected_o, expected_h = ref(*args, initial_state=h0s)
    o_doc, h_doc = np.asarray(o)[:, a:b], np.asarray(finals)[doc]
    assert np.all(np.isfinite(o_doc)) and np.all(np.isfinite(h_doc))
    assert rel_err(o_doc, expected_o[:, a:b]) <= 1e-5
    assert rel_err(h_doc, expected_h[doc]) <= 1e-5

    def doc_loss(arrays):
        o, finals = ref(*arrays[:-1], initial_state=arrays[-1])
        lo, lh = _loss_terms(o, finals, np)
        return float(np.sum(lo[:, a:b]) + np.sum(lh[doc]))

    base = [np.asarray(x, np.float64) for x in [*args, h0s]]
    rng = np.random.default_rng(314159)
    eps = 1e-6
    for i, grad in enumerate([*grads, d_h0s]):
        grad = np.asarray(grad, np.float64)
        # A direction in this document's tokens (its initial state for the last argument).
        d = np.zeros_like(base[i])
        part = np.s_[:, a:b] if i < len(grads) else np.s_[doc]
        d[part] = rng.normal(size=d[part].shape)
        assert np.all(np.isfinite(grad[part])), i
        plus = [x + eps * d if j == i else x for j, x in enumerate(base)]
        minus = [x - eps * d if j == i else x for j, x in enumerate(base)]
        expected = (doc_loss(plus) - doc_loss(minus)) / (2 * eps)
        actual = float(np.sum(grad[part] * d[part]))  # the rest may be NaN
        assert abs(actual - expected) <= 1e-4 * max(abs(expected), 1e-3), (i, actual, expected)


def _check_both_ways(family: Family, cp, layout, exchange):
    # A NaN in v of document 0 (token 2) stays out of document 1, forward and backward; a
    # NaN in v of document 1 (token 9, so its cotangents are NaN too) stays out of
    # document 0's gradients.
    args, h0s = _inputs(family, 7)
    fn = _packed_grad_fn(family, cp, layout, exchange)
    v = family.arg_names.index("v")
    for token, bad_doc, clean_doc in [(2, 0, 1), (9, 1, 0)]:
        broken = _with(args, v, token)
        out = fn(broken, h0s)
        a, b = DOCS[bad_doc]
        assert not np.any(np.isfinite(np.asarray(out[0])[:, token:b]))
        assert not np.any(np.isfinite(np.asarray(out[1])[bad_doc]))
        _check_document_is_clean(family, broken, h0s, clean_doc, out)


def test_reset_map_forgets_a_nan_exactly():
    # The monoid itself: a resetting map composed after, or applied to, a NaN.
    k, v = 3, 2
    nan_map = dcp.AffineMap(jnp.eye(k), jnp.full((k, v), jnp.nan))
    u = jnp.arange(k * v, dtype=jnp.float32).reshape(k, v)
    reset = dcp.AffineMap(jnp.zeros((k, k)), u).with_resets(True)
    assert np.array_equal(nan_map.then(reset)(jnp.ones((k, v))), u)
    assert np.array_equal(reset(jnp.full((k, v), jnp.nan)), u)
    assert np.array_equal(reset.adjoint(u)(jnp.full((k, v), jnp.nan)), u)
    # Not resetting: the NaN goes through, as 0 * nan does.
    assert np.all(np.isnan(nan_map.then(dcp.AffineMap(jnp.zeros((k, k)), u))(u)))
    diagonal = dcp.DiagonalAffineMap(jnp.zeros(k), u).with_resets(True)
    nan_diagonal = dcp.DiagonalAffineMap(jnp.ones(k), jnp.full((k, v), jnp.nan))
    assert np.array_equal(nan_diagonal.then(diagonal)(u), u)
    assert np.array_equal(diagonal.adjoint(u)(jnp.full((k, v), jnp.nan)), u)
    # Per batch row; the composition resets where either map does.
    rows = dcp.AffineMap(jnp.zeros((2, k, k)), jnp.stack([u, u])).with_resets(
        jnp.array([True, False])
    )
    out = dcp.AffineMap(jnp.zeros((2, k, k)), jnp.full((2, k, v), jnp.nan)).then(rows)
    assert out.resets is not None and np.array_equal(out.resets, [True, False])
    assert np.array_equal(out(u[None].repeat(2, 0))[0], u)
    assert np.all(np.isnan(out(u[None].repeat(2, 0))[1]))


# Quick: the dense map under every exchange, each layout twice; the diagonal map once each.
_QUICK = [
    (GATED_DELTA_RULE, "allgather", dcp.Contiguous()),
    (GATED_DELTA_RULE, "ppermute", dcp.Zigzag()),
    (GATED_DELTA_RULE, "ring", dcp.Contiguous()),
    (GATED_DELTA_RULE, "auto", dcp.Zigzag()),
    (GLA, "ring", dcp.Zigzag()),
    (GLA, "ppermute", dcp.Contiguous()),
]


def _packed_cases():
    params = [
        pytest.param(
            f,
            None,
            None,
            None,
            id=f"{f.name}-one_device",
            marks=() if f in (GATED_DELTA_RULE, GLA) else (pytest.mark.slow,),
        )
        for f in FAMILIES
    ]
    # On 4 ranks: the quick cases in the default run; the slow run adds a cover of every
    # pair (family and exchange, family and layout, exchange and layout).
    grid = pairwise(
        [FAMILIES, EXCHANGES, LAYOUTS],
        ids=[lambda f: f.name, exchange_id, repr],
        fast=lambda f, ex, layout: (f, type(ex).__name__.lower(), layout) in _QUICK,
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    )
    for p in grid:
        family, exchange, layout = p.values
        params.append(pytest.param(family, 4, layout, exchange, id=p.id, marks=p.marks))
    return params


@pytest.mark.parametrize("family, cp, layout, exchange", _packed_cases())
def test_nan_stays_in_its_document(family, cp, layout, exchange):
    _check_both_ways(family, cp, layout, exchange)


# ---------------------------------------------------------------------------------------
# Softmax attention: a non-finite token reaches no earlier token
# ---------------------------------------------------------------------------------------

ATTN_T, ATTN_BAD = 32, 13  # tiles of 4: token 12 shares the bad token's diagonal tile
ATTN_CASES = [pytest.param(None, None, None, id="one_device")] + [
    pytest.param(4, layout, kv, id=f"cp4-{type(layout).__name__.lower()}-{kv}")
    for layout in LAYOUTS
    for kv in ("allgather", "ring")
]


def _earlier_loss(out):
    """A loss of the outputs before the bad token only: its cotangents are 0 from there on."""
    w = jnp.asarray(_weights(out.shape, np.cos), out.dtype)
    return jnp.sum(jnp.where(jnp.arange(out.shape[0])[:, None] < ATTN_BAD, jnp.sin(out) * w, 0))


def _on_ranks(fn, cp: int | None, layout):
    """`fn(params, x) -> out` (`x`, `out` sequence-major) on one device, or inside
    `jax.shard_map` over `cp` ranks in `layout`, called on global arrays in sequence order:
    `(params, x) -> out`, `fn` then taking `ctx` (a `ContextParallel` or `None`)."""
    if cp is None:
        return ft.partial(fn, ctx=None)
    auto = (jax.sharding.AxisType.Auto,)  # the global arrays are laid out inside `jit`
    mesh = jax.make_mesh((cp,), ("cp",), axis_types=auto, devices=jax.devices()[:cp])
    ctx = dcp.ContextParallel("cp", layout=layout)
    spec = jax.sharding.PartitionSpec("cp")
    local = jax.shard_map(
        ft.partial(fn, ctx=ctx),
        mesh=mesh,
        in_specs=(jax.sharding.PartitionSpec(), spec),
        out_specs=spec,
    )

    def run(params, x):
        return layout.from_layout(local(params, layout.to_layout(x, cp, axis=0)), cp, axis=0)

    return run


@ft.cache
def _attention_grad_fn(cp: int | None, layout, kv_schedule):
    """Jitted `x -> (out, d earlier loss / dx)` of one attention layer (grouped queries,
    output gate, q/k norms: Qwen3.5's), on one device or on `cp` ranks."""
    attn = dcp.nn.CausalSelfAttention(
        16, 4, 8, num_kv_heads=2, output_gate=True, qk_norm=True, tile_size=4, key=jax.random.key(0)
    )
    params, static = eqx.partition(attn, eqx.is_array)

    def call(params, x, ctx):
        return eqx.combine(params, static)(x, cp=ctx, kv_schedule=kv_schedule or "allgather")

    run = _on_ranks(call, cp, layout)

    @jax.jit
    def fn(x):
        out, vjp = jax.vjp(lambda x: run(params, x), x)
        (dx,) = vjp(jax.grad(_earlier_loss)(out))
        return out, dx

    return fn


def _check_earlier_tokens(fn, x, bad_x):
    """`fn(x) -> (out, dx)`: with `bad_x` (non-finite from token `ATTN_BAD` on) the outputs
    and gradients of the earlier tokens are finite and equal the clean run's, exactly; the
    bad token's own outputs are non-finite."""
    clean_out, clean_dx = (np.asarray(a) for a in fn(x))
    out, dx = (np.asarray(a) for a in fn(bad_x))
    assert np.all(np.isfinite(out[:ATTN_BAD])) and np.all(np.isfinite(dx[:ATTN_BAD]))
    assert np.array_equal(out[:ATTN_BAD], clean_out[:ATTN_BAD])
    assert np.array_equal(dx[:ATTN_BAD], clean_dx[:ATTN_BAD])
    assert not np.any(np.isfinite(out[ATTN_BAD]))


@pytest.mark.parametrize("cp, layout, kv_schedule", ATTN_CASES)
def test_attention_non_finite_token_reaches_no_earlier_token(cp, layout, kv_schedule):
    # A NaN (then an infinity) in one token's input: every earlier token's output and
    # gradient is the clean run's, on one device and on 4 ranks (both layouts, both
    # exchanges of the keys and values), forward and backward.
    fn = _attention_grad_fn(cp, layout, kv_schedule)
    x = jnp.asarray(_weights((ATTN_T, 16), np.sin))
    for value in (np.nan, np.inf):
        _check_earlier_tokens(fn, x, x.at[ATTN_BAD, 3].set(value))


def test_attention_kernel_non_finite_rows():
    # The kernel alone: a NaN value, an infinite key, a NaN query, each in one row of one
    # head: no other query's output or gradient changes; the queries that see the row are
    # non-finite in that head's group only.
    t, kvh, group, d = 16, 2, 2, 4
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.normal(size=(t, h, d)), jnp.float32) for h in (kvh * group, kvh, kvh)
    )
    pos = jnp.arange(t, dtype=jnp.int32)

    @jax.jit
    def fn(q, k, v):
        def f(q, k, v):
            out, _ = blockwise_attention(
                q, k, v, pos, cp=None, kv_schedule="allgather", tile_size=4
            )
            return out

        out, vjp = jax.vjp(f, q, k, v)
        ct = jnp.where(jnp.arange(t)[:, None, None] < 9, 1.0, 0.0) * jnp.cos(out)
        return out, vjp(ct.astype(out.dtype))

    clean_out, clean_grads = fn(q, k, v)
    for arg, head, value in [(2, 1, np.nan), (1, 0, np.inf), (0, 3, np.nan)]:
        args = [q, k, v]
        args[arg] = args[arg].at[9, head, 1].set(value)
        out, grads = fn(*args)
        out = np.asarray(out)
        assert np.array_equal(out[:9], clean_out[:9])
        for g, c in zip(grads, clean_grads):
            assert np.array_equal(g[:9], c[:9]), arg
        seen = [head] if arg == 0 else [head * group + i for i in range(group)]
        others = [h for h in range(kvh * group) if h not in seen]
        # A bad query spoils its own row; a bad key or value every later query of its group.
        rows = slice(9, 10) if arg == 0 else slice(9, t)
        assert not np.any(np.isfinite(np.asarray(out)[rows][:, seen]))
        assert np.array_equal(out[rows][:, others], clean_out[rows][:, others])


@ft.cache
def _model_grad_fn(cp: int | None, layout, kv_schedule):
    """Jitted `embedding table -> (logits, d earlier loss / d table)` of a two-block
    attention `HybridLM` on tokens `0 .. T - 1` (token `i` at position `i`)."""
    model = dcp.nn.HybridLM(
        ATTN_T,
        16,
        2,
        mixers=["attention", "attention"],
        num_attention_heads=2,
        attention_head_dim=8,
        intermediate_size=16,
        tile_size=4,
        key=jax.random.key(0),
    )
    tokens = jnp.arange(ATTN_T, dtype=jnp.int32)

    def call(table, tokens, ctx):
        m = eqx.tree_at(lambda m: m.embed.weight, model, table)
        return m(tokens, cp=ctx, kv_schedule=kv_schedule or "allgather")

    run = _on_ranks(call, cp, layout)

    @jax.jit
    def fn(table):
        out, vjp = jax.vjp(lambda table: run(table, tokens), table)
        (d_table,) = vjp(jax.grad(_earlier_loss)(out))
        return out, d_table

    return fn, model.embed.weight


@pytest.mark.parametrize(
    "cp, layout, kv_schedule",
    [ATTN_CASES[0], pytest.param(4, dcp.Zigzag(), "ring", id="cp4-zigzag-ring")],
)
def test_model_non_finite_token_reaches_no_earlier_token(cp, layout, kv_schedule):
    # Through a model: a NaN in one token's embedding leaves every earlier token's logits
    # and the gradients of the earlier tokens' embeddings (token i at position i) as in the
    # clean run, though the later blocks' backward makes the bad token's cotangents NaN.
    fn, table = _model_grad_fn(cp, layout, kv_schedule)
    _check_earlier_tokens(fn, table, table.at[ATTN_BAD].set(np.nan))


# A NaN cotangent (a later layer's backward) in the rows of the middle of three documents,
# which cross tiles of 4 (tokens 4-7 and 16-19 straddle a boundary) and the 4 ranks.
COT_CU = (0, 6, 19, 32)
COT_OTHER = np.r_[0:6, 19:32]
COT_CASES = [
    pytest.param(None, None, None, id="one_device"),
    pytest.param(4, dcp.Zigzag(), "ring", id="cp4-zigzag-ring"),
] + [
    pytest.param(4, layout, kv, id=f"cp4-{name}-{kv}", marks=pytest.mark.slow)
    for layout, name, kv in (
        (dcp.Zigzag(), "zigzag", "allgather"),
        (dcp.Contiguous(), "contiguous", "allgather"),
        (dcp.Contiguous(), "contiguous", "ring"),
    )
]


def _cotangent_layers(tile_size: int):
    key = jax.random.key(0)
    attn = dcp.nn.CausalSelfAttention(
        16, 4, 8, num_kv_heads=2, output_gate=True, qk_norm=True, tile_size=tile_size, key=key
    )
    mla = dcp.nn.MultiHeadLatentAttention(
        16,
        2,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        tile_size=tile_size,
        key=key,
    )
    return {"attention": attn, "latent": mla}


@ft.cache
def _cotangent_grad_fn(name: str, cp: int | None, layout, kv_schedule, cu):
    """Jitted `(x, ct) -> dx`: the input gradient of one attention layer for the output
    cotangent `ct`, with the documents `cu` (or one, `None`: then one tile per sequence)."""
    layer = _cotangent_layers(4 if cu else 64)[name]
    params, static = eqx.partition(layer, eqx.is_array)

    def call(params, x, ctx):
        mixer = eqx.combine(params, static)
        cu_seqlens = None if cu is None else jnp.asarray(cu, jnp.int32)
        return mixer(x, cp=ctx, cu_seqlens=cu_seqlens, kv_schedule=kv_schedule or "allgather")

    run = _on_ranks(call, cp, layout)

    @jax.jit
    def fn(x, ct):
        _, vjp = jax.vjp(lambda x: run(params, x), x)
        return vjp(ct)[0]

    return fn


def _check_nan_cotangent(name, cp, layout, kv_schedule):
    x = jnp.asarray(_weights((32, 16), np.sin))
    ct = jnp.asarray(_weights((32, 16), np.cos)).at[6:19].set(jnp.nan)
    dx = np.asarray(_cotangent_grad_fn(name, cp, layout, kv_schedule, COT_CU)(x, ct))
    alone = _cotangent_grad_fn(name, None, None, None, None)
    expected = np.concatenate([np.asarray(alone(x[a:b], ct[a:b])) for a, b in ((0, 6), (19, 32))])
    assert np.all(np.isfinite(dx[COT_OTHER]))
    assert rel_err(dx[COT_OTHER], expected) <= 1e-5
    assert np.all(np.isnan(dx[6:19]))


@pytest.mark.parametrize("cp, layout, kv_schedule", COT_CASES)
@pytest.mark.parametrize("name", ["attention", "latent"])
def test_attention_nan_cotangent_stays_in_its_document(name, cp, layout, kv_schedule):
    # A NaN in the output cotangents of the middle document: the other documents' input
    # gradients are those of each document alone, finite, though their tiles hold the
    # middle document's rows (a masked weight 0 times a NaN cotangent is NaN).
    _check_nan_cotangent(name, cp, layout, kv_schedule)

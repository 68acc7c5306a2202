"""Blockwise causal attention: against float64 references written here, on one device and
context parallel (both layouts, both key/value exchanges), forward and gradients; its
precision policies (bfloat16 products against the float64 reference, and the products'
dtypes in the compiled HLO); its tile schedules; and its memory, linear in the sequence
length (and, around the ring, in the local length only)."""

import functools as ft
from typing import cast

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp._hlo import products
from deltanet_cp.nn import CausalSelfAttention
from deltanet_cp.nn._context import local_positions
from deltanet_cp.nn._flash import (
    blockwise_attention,
    decode_attention as _decode_attention,
    flash,
    to_blocks,
)
from deltanet_cp.nn._schedule import _allgather_schedule, _ring_schedule, tile_loops, tiling

from .helpers import directional_check, rel_err


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


HIDDEN, HEADS, HEAD_DIM, THETA = 16, 2, 8, 10_000.0
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}


# ---------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------


def _weights(attn: CausalSelfAttention) -> list[np.ndarray]:
    lins = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
    return [np.asarray(lin.weight, np.float64) for lin in lins]


def reference_numpy(x, wq, wk, wv, wo, *, heads=HEADS, theta=THETA) -> np.ndarray:
    """Causal softmax attention with half-split RoPE, one query at a time, float64 numpy."""
    x = np.asarray(x, np.float64)
    t, dim = x.shape[0], wq.shape[0] // heads
    q, k, v = ((x @ w.T).reshape(t, heads, dim) for w in (wq, wk, wv))
    half = dim // 2
    freq = theta ** (-np.arange(half) / half)
    out = np.zeros((t, heads, dim))

    def rope(y, pos):  # (heads, dim) at position pos
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        return np.concatenate(
            [y[:, :half] * c - y[:, half:] * s, y[:, half:] * c + y[:, :half] * s], -1
        )

    keys = np.stack([rope(k[j], j) for j in range(t)])
    for i in range(t):
        qi = rope(q[i], i)
        scores = np.array([[qi[h] @ keys[j, h] for j in range(i + 1)] for h in range(heads)])
        scores /= np.sqrt(dim)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[i] = np.einsum("hk,khd->hd", p, v[: i + 1])
    return out.reshape(t, heads * dim) @ wo.T


def reference_dense(x, wq, wk, wv, wo, *, heads=HEADS, theta=THETA):
    """The same as one dense masked softmax in jax.numpy (float64 under `jax.enable_x64`),
    for gradients by autodiff."""
    t, dim = x.shape[0], wq.shape[0] // heads
    q, k, v = ((x @ w.T).reshape(t, heads, dim) for w in (wq, wk, wv))
    half = dim // 2
    ang = (
        jnp.arange(t, dtype=x.dtype)[:, None, None]
        * (theta ** (-jnp.arange(half, dtype=x.dtype) / half))[None, None, :]
    )

    def rope(y):
        y1, y2 = y[..., :half], y[..., half:]
        return jnp.concatenate(
            [y1 * jnp.cos(ang) - y2 * jnp.sin(ang), y2 * jnp.cos(ang) + y1 * jnp.sin(ang)], -1
        )

    return dense_attention(rope(q), rope(k), v).reshape(t, heads * dim) @ wo.T


def dense_attention(q, k, v):
    """Causal softmax attention as one dense masked softmax in jax.numpy: `q` `(seq, heads,
    dim)` (not yet scaled), `k`, `v` `(seq, kv_heads, dim)`, query head `h` reading key
    head `h // (heads // kv_heads)`."""
    t, h, dim = q.shape
    group = h // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, v)


def _loss_weights(t: int) -> np.ndarray:
    return np.cos(np.arange(t * HIDDEN, dtype=np.float32)).reshape(t, HIDDEN)


@jax.jit
def _dense_grads(args, w):
    return jax.grad(lambda a: jnp.sum(reference_dense(*a) * w))(args)


def _reference_grads(attn, x, w):
    """`d/d(x, wq, wk, wv, wo)` of `sum(out * w)` for the dense float64 reference."""
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in [x, *_weights(attn)]]
        grads = _dense_grads(args, jnp.asarray(w, jnp.float64))
        return [np.asarray(g) for g in grads]


# ---------------------------------------------------------------------------------------
# The layer, one device and context parallel
# ---------------------------------------------------------------------------------------


def _grads_of(grads_module, dx) -> list[np.ndarray]:
    lins = (grads_module.q_proj, grads_module.k_proj, grads_module.v_proj, grads_module.o_proj)
    return [np.asarray(dx)] + [np.asarray(lin.weight) for lin in lins]


@ft.cache
def _attn(block_size: int) -> CausalSelfAttention:
    return CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, tile_size=block_size, key=jr.key(0))


def _inputs(t: int):
    return jr.normal(jr.key(1), (t, HIDDEN)), jnp.asarray(_loss_weights(t))


def _run_single(attn, x, w):
    def loss(attn, x):
        out = attn(x)
        return jnp.sum(out * w), out

    (_, out), (g_attn, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
        attn, x
    )
    return np.asarray(out), _grads_of(g_attn, dx)


def _run_cp(attn, x, w, cp: int, layout, kv_exchange: str):
    """Output and gradients of `sum(out * w)` with `x` sharded over `cp` ranks, in sequence
    order whatever the layout."""
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    x, w = layout.to_layout(x, cp, axis=0), layout.to_layout(w, cp, axis=0)
    params, static = eqx.partition(attn, eqx.is_array)
    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, x, w):
        out = eqx.combine(params, static)(x, cp=context, kv_schedule=kv_exchange)
        return jax.lax.psum(jnp.sum(out * w), "cp"), out

    seq = P("cp")
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq), out_specs=(P(), seq))
    x, w = (jax.device_put(a, NamedSharding(mesh, seq)) for a in (x, w))
    (_, out), (g_params, dx) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        params, x, w
    )
    out, dx = layout.from_layout(out, cp, axis=0), layout.from_layout(dx, cp, axis=0)
    return np.asarray(out), _grads_of(eqx.combine(g_params, static), dx)


def _check(out, grads, attn, x, w):
    x64 = np.asarray(x, np.float64)
    assert rel_err(out, reference_numpy(x64, *_weights(attn))) <= 1e-5
    expected = _reference_grads(attn, x64, np.asarray(w, np.float64))
    errors = [rel_err(g, e) for g, e in zip(grads, expected)]
    assert max(errors) <= 1e-5, errors


@pytest.mark.parametrize("block_size, t", [(4, 24), (7, 21), (128, 24)])
def test_single_device(block_size, t):
    attn = _attn(block_size)
    x, w = _inputs(t)
    _check(*_run_single(attn, x, w), attn, x, w)


def test_single_device_finite_differences():
    # The gradients against central differences of the numpy loop itself (no autodiff).
    attn = _attn(4)
    x, w = _inputs(12)
    _, grads = _run_single(attn, x, w)
    w64 = np.asarray(w, np.float64)

    def loss(arrays):
        return float(np.sum(reference_numpy(*arrays) * w64))

    errors = directional_check(grads, loss, [np.asarray(x), *_weights(attn)])
    assert max(errors) <= 1e-4, errors


def test_bfloat16_parameters():
    # bf16 weights and inputs: the tiles accumulate in float32, the output is bf16.
    attn = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _attn(4))
    x, w = _inputs(16)
    out, grads = _run_single(attn, x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    x64 = np.asarray(x.astype(jnp.bfloat16), np.float64)
    assert rel_err(out, reference_numpy(x64, *_weights(attn))) <= 3e-2
    expected = _reference_grads(attn, x64, np.asarray(w.astype(jnp.bfloat16), np.float64))
    assert max(rel_err(g, e) for g, e in zip(grads, expected)) <= 5e-2


# Every cp, layout and exchange in the default run (each pair of them once); the rest slow.
_CP_FAST = {
    (2, "contiguous", "ring"),
    (2, "zigzag", "allgather"),
    (4, "zigzag", "ring"),
    (4, "contiguous", "allgather"),
}
CP_CASES = [
    pytest.param(
        cp,
        name,
        kv,
        id=f"cp{cp}-{name}-{kv}",
        marks=() if (cp, name, kv) in _CP_FAST else (pytest.mark.slow,),
    )
    for cp in (2, 4)
    for name in LAYOUTS
    for kv in ("allgather", "ring")
]


@pytest.mark.parametrize("cp, layout, kv_exchange", CP_CASES)
def test_context_parallel(cp, layout, kv_exchange):
    # Block 4: every zigzag piece (32 / 2cp tokens) is 1 to 4 tiles, so the schedules
    # have off-diagonal tiles, partial diagonals and skipped tiles on every rank.
    attn = _attn(4)
    x, w = _inputs(32)
    out, grads = _run_cp(attn, x, w, cp, LAYOUTS[layout], kv_exchange)
    _check(out, grads, attn, x, w)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_exchange", ["allgather", "ring"])
@pytest.mark.parametrize("t, block_size", [(96, 4), (64, 8), (48, 128)])
def test_context_parallel_grid(cp, layout, kv_exchange, t, block_size):
    if t % (2 * cp) or (t // (2 * cp)) % min(block_size, t // (2 * cp)):
        pytest.skip("the pieces are not whole tiles")
    attn = _attn(block_size)
    x, w = _inputs(t)
    out, grads = _run_cp(attn, x, w, cp, LAYOUTS[layout], kv_exchange)
    _check(out, grads, attn, x, w)


# ---------------------------------------------------------------------------------------
# The kernel: float64, through both outputs
# ---------------------------------------------------------------------------------------


def test_kernel_gradients_through_lse():
    # The tile kernel alone in float64, on keys in a scrambled order with a schedule that
    # lists every tile: output and log-sum-exp against a dense softmax, and the gradients
    # of a loss using both (the log-sum-exp's cotangent enters ds = p (dp - D + dlse)).
    with jax.enable_x64(True):
        t, h, d, b = 12, 2, 4, 3
        q, k, v = (jr.normal(key, (t, h, d), jnp.float64) for key in jr.split(jr.key(2), 3))
        pos_q = jnp.arange(t, dtype=jnp.int32)
        pos_k = jnp.asarray(np.random.default_rng(0).permutation(t), jnp.int32)
        n = t // b
        every = np.stack([np.repeat(np.arange(n), n), np.tile(np.arange(n), n)], -1)
        tiles = jnp.asarray(every[None], jnp.int32)
        row, count = jnp.asarray(0, jnp.int32), jnp.asarray(n * n, jnp.int32)
        wo = jr.normal(jr.key(3), (n, b, h, d), jnp.float64)
        wl = jr.normal(jr.key(4), (n, h, b), jnp.float64)

        def blockwise(q, k, v):
            args = (to_blocks(q, b), to_blocks(k, b), to_blocks(v, b))
            out = flash(*args, to_blocks(pos_q, b), to_blocks(pos_k, b), tiles, row, count)
            return cast(tuple[jax.Array, jax.Array], out)

        def dense(q, k, v):
            s = jnp.einsum("qhd,khd->hqk", q, k)
            s = jnp.where((pos_q[:, None] >= pos_k[None, :])[None], s, -jnp.inf)
            lse = jax.nn.logsumexp(s, axis=-1)  # (h, q)
            out = jnp.einsum("hqk,khd->qhd", jnp.exp(s - lse[..., None]), v)
            return to_blocks(out, b), lse.reshape(h, n, b).transpose(1, 0, 2)

        def loss(fn):
            return lambda *a: jnp.sum(fn(*a)[0] * wo) + jnp.sum(fn(*a)[1] * wl)

        for got, want in zip(jax.jit(blockwise)(q, k, v), jax.jit(dense)(q, k, v)):
            assert rel_err(got, want) <= 1e-13
        got = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2)))(q, k, v)
        for g, e in zip(got, want):
            assert rel_err(g, e) <= 1e-12


# ---------------------------------------------------------------------------------------
# The precision policies
# ---------------------------------------------------------------------------------------

# Grouped-query attention at a moderate size: 4 query heads reading 2 key/value heads.
POLICY_T, POLICY_HEADS, POLICY_KV_HEADS, POLICY_DIM, POLICY_BLOCK = 1024, 4, 2, 64, 64
OUT_BOUND, GRAD_BOUND = 5e-3, 8e-3  # relative RMS error, bfloat16 inputs and products


def rms_ratio(actual, expected) -> float:
    """rms(actual - expected) / rms(expected), in float64."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {e.shape}")
    return float(np.sqrt(np.mean((a - e) ** 2) / np.mean(e**2)))


def _policy_inputs(t: int = POLICY_T, dtype=jnp.bfloat16):
    """`(q, k, v, w)`: queries, keys and values in `dtype` and a float32 loss weight."""
    kq, kk, kv, kw = jr.split(jr.key(5), 4)
    q = jr.normal(kq, (t, POLICY_HEADS, POLICY_DIM)).astype(dtype)
    k = jr.normal(kk, (t, POLICY_KV_HEADS, POLICY_DIM)).astype(dtype)
    v = jr.normal(kv, (t, POLICY_KV_HEADS, POLICY_DIM)).astype(dtype)
    return q, k, v, jr.normal(kw, (t, POLICY_HEADS, POLICY_DIM))


@ft.cache
def _policy_reference(t: int = POLICY_T):
    """Output and `d/d(q, k, v)` of `sum(out * w)` for the float64 dense attention, on the
    bfloat16 inputs' values."""
    inputs = [np.asarray(a, np.float64) for a in _policy_inputs(t)]  # drawn in float32
    with jax.enable_x64(True):
        q, k, v, w = (jnp.asarray(a) for a in inputs)

        def loss(q, k, v):
            out = dense_attention(q, k, v)
            return jnp.sum(out * w), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v
        )
        return np.asarray(out), [np.asarray(g) for g in grads]


def _kernel_loss(precision, cp=None, kv_exchange="allgather"):
    """`(q, k, v, w) -> (sum(out * w), out)` of the kernel on this rank's tokens (summed over
    the ranks with `cp`)."""

    def loss(q, k, v, w):
        pos = local_positions(cp, q.shape[0])
        out, _ = blockwise_attention(
            q,
            k,
            v,
            pos,
            cp=cp,
            kv_schedule=kv_exchange,
            tile_size=POLICY_BLOCK,
            precision=precision,
        )
        total = jnp.sum(out.astype(jnp.float32) * w)
        return (total if cp is None else jax.lax.psum(total, cp.axis_name)), out

    return loss


_GRAD = ft.partial(jax.value_and_grad, argnums=(0, 1, 2), has_aux=True)


def _run_kernel(precision, q, k, v, w):
    """Output and `(dq, dk, dv)` of the kernel on one device."""
    (_, out), grads = jax.jit(_GRAD(_kernel_loss(precision)))(q, k, v, w)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _run_kernel_cp(precision, q, k, v, w, cp: int, layout: str, kv_exchange: str):
    """Output and `(dq, dk, dv)` of the kernel over `cp` ranks under the layout named
    `layout`, in sequence order."""
    lay = LAYOUTS[layout]
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P("cp")
    f = jax.shard_map(
        _GRAD(_kernel_loss(precision, dcp.ContextParallel("cp", layout=lay), kv_exchange)),
        mesh=mesh,
        in_specs=(seq,) * 4,
        out_specs=((P(), seq), (seq,) * 3),
    )
    args = [
        jax.device_put(lay.to_layout(a, cp, axis=0), NamedSharding(mesh, seq)) for a in (q, k, v, w)
    ]
    (_, out), grads = jax.jit(f)(*args)
    out, *grads = (np.asarray(lay.from_layout(a, cp, axis=0)) for a in (out, *grads))
    return out, grads


def _policy_errors(out, grads) -> list[float]:
    """Relative RMS errors of the output and of `dq, dk, dv` against the float64 reference."""
    want_out, want_grads = _policy_reference()
    return [rms_ratio(out, want_out)] + [rms_ratio(g, e) for g, e in zip(grads, want_grads)]


@ft.cache
def _single_device_errors(precision: str) -> list[float]:
    return _policy_errors(*_run_kernel(precision, *_policy_inputs()))


@pytest.mark.parametrize("precision", ["bfloat16", pytest.param("highest", marks=pytest.mark.slow)])
def test_bfloat16_inputs_against_float64(precision):
    # bfloat16 queries, keys and values (the output and gradients come back in bfloat16):
    # with bfloat16 tile products the errors stay within the bounds of bfloat16 training;
    # the float32 ("highest") products on the same inputs meet them too.
    out, grads = _run_kernel(precision, *_policy_inputs())
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    errors = _single_device_errors(precision)
    assert errors[0] <= OUT_BOUND and max(errors[1:]) <= GRAD_BOUND, errors


@pytest.mark.parametrize(
    "layout, kv_exchange",
    [
        pytest.param("zigzag", "ring"),
        pytest.param("contiguous", "allgather", marks=pytest.mark.slow),
        pytest.param("contiguous", "ring", marks=pytest.mark.slow),
        pytest.param("zigzag", "allgather", marks=pytest.mark.slow),
    ],
)
def test_bfloat16_policy_context_parallel(layout, kv_exchange):
    # The same bounds over 4 ranks, and within 10% of one device's errors: the statistics
    # and accumulators stay float32 on every rank, around the ring, and in the sum of the
    # gathered keys' gradients over the ranks, so the error does not grow with the ranks.
    q, k, v, w = _policy_inputs()
    out, grads = _run_kernel_cp("bfloat16", q, k, v, w, 4, layout, kv_exchange)
    errors = _policy_errors(out, grads)
    assert errors[0] <= OUT_BOUND and max(errors[1:]) <= GRAD_BOUND, errors
    single = _single_device_errors("bfloat16")
    assert all(e <= 1.1 * s for e, s in zip(errors, single)), (errors, single)


def test_default_policy_is_highest():
    # On float32 inputs the kernel's default policy is "highest": outputs and gradients
    # equal (the bfloat16 policy's different products: test_bfloat16_policy_hlo).
    t = 128
    q, k, v, w = _policy_inputs(t, jnp.float32)

    def loss(q, k, v):
        pos = jnp.arange(t)
        out, _ = blockwise_attention(
            q, k, v, pos, cp=None, kv_schedule="allgather", tile_size=POLICY_BLOCK
        )
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    highest_out, highest_grads = _run_kernel("highest", q, k, v, w)
    assert np.array_equal(out, highest_out)
    assert all(np.array_equal(a, b) for a, b in zip(grads, highest_grads))


def test_decode_bfloat16_policy():
    # One query against a bfloat16 cache of 1024 entries (700 of them visible), bfloat16
    # products: within the output bound of the float64 softmax over the visible entries.
    q, k, v, _ = _policy_inputs()
    position = 699
    got = _decode_attention(q[position], k, v, jnp.asarray(position), precision="bfloat16")
    assert got.dtype == jnp.float32
    want = _policy_reference()[0][position]
    assert rms_ratio(got, want) <= OUT_BOUND
    exact = _decode_attention(q[position], k, v, jnp.asarray(position))
    assert rms_ratio(exact, want) <= 1e-5


def test_bad_precision(without_runtime_typecheck):
    q, k, v = jnp.zeros((64, 4, 8)), jnp.zeros((64, 2, 8)), jnp.zeros((64, 2, 8))
    for bad in (None, "float32", jax.lax.Precision.HIGHEST):
        with pytest.raises(ValueError, match="precision"):
            blockwise_attention(
                q,
                k,
                v,
                jnp.arange(64),
                cp=None,
                kv_schedule="allgather",
                tile_size=64,
                precision=bad,  # pyright: ignore[reportArgumentType]
            )


@pytest.mark.parametrize(
    "kv_exchange", [None, pytest.param("allgather", marks=pytest.mark.slow), "ring"]
)
def test_bfloat16_policy_hlo(kv_exchange):
    # Compiled on XLA:CPU, forward and backward: every tile product (q k^T and p v; the
    # recomputed q k^T, do v^T, ds k, ds^T q and p^T do) multiplies bfloat16 operands into
    # float32, and under "highest" every one multiplies float32 at HIGHEST.
    args = _policy_inputs(128, jnp.float32)

    def compiled(precision) -> str:
        if kv_exchange is None:
            loss = _kernel_loss(precision)
            fn, inputs = jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)), args
        else:
            loss = _kernel_loss(
                precision, dcp.ContextParallel("cp", layout=dcp.Zigzag()), kv_exchange
            )
            mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
            fn = jax.shard_map(
                jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2)),
                mesh=mesh,
                in_specs=(P("cp"),) * 4,
                out_specs=(P("cp"),) * 3,
            )
            inputs = [jax.device_put(a, NamedSharding(mesh, P("cp"))) for a in args]
        # Lowered for a GPU: on XLA:CPU the policy multiplies the bfloat16-rounded operands
        # in float32 (see `deltanet_cp.chunkops.einsum`), so its compiled text has no
        # bfloat16 dot to read.
        return export.export(jax.jit(fn), platforms=["cuda"])(*inputs).mlir_module()

    # The tile products: 2 forward and 5 backward per tile loop, each loop lowered once
    # (the ring: the diagonal and the loop over the other ranks' keys).
    loops = 2 if kv_exchange == "ring" else 1
    bf16 = [(*p.operands, p.result) for p in products(compiled("bfloat16"))]
    print(f"{kv_exchange}: {bf16.count(('bf16', 'bf16', 'f32'))} of {len(bf16)} dots bf16")
    assert bf16 == [("bf16", "bf16", "f32")] * 7 * loops, bf16
    hi = products(compiled("highest"))
    assert [(*p.operands, p.result) for p in hi] == [("f32", "f32", "f32")] * 7 * loops


# ---------------------------------------------------------------------------------------
# The schedules
# ---------------------------------------------------------------------------------------


def _needed(pos_q: np.ndarray, pos_k: np.ndarray, b: int) -> set[tuple[int, int]]:
    """The tiles with at least one visible (query, key) pair."""
    first_k = pos_k.reshape(-1, b).min(1)
    last_q = pos_q.reshape(-1, b).max(1)
    return {
        (i, j) for i in range(len(last_q)) for j in range(len(first_k)) if last_q[i] >= first_k[j]
    }


def _listed(schedule, r: int) -> set[tuple[int, int]]:
    tiles = schedule.listed(r)
    assert len(set(tiles)) == len(tiles)
    return set(tiles)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_schedules_are_exactly_the_needed_tiles(cp, layout):
    # Every tile with a visible pair is computed, no tile wholly in the future is, and with
    # the zigzag layout every rank computes the same number: (2 cp - 1) m^2 + m (m + 1)
    # through the all-gather, 2 m^2 + m, then 2 m^2 per ring step.
    layout = LAYOUTS[layout]
    m, b = 3, 2
    t = len(layout.held(cp)[0]) * m * b  # m tiles of b in each piece
    table = layout.position_table(t, cp)
    gathered = _allgather_schedule(layout.held(cp), m)
    ring = [_ring_schedule(layout.held(cp), m, step) for step in range(cp)]
    for r in range(cp):
        assert _listed(gathered, r) == _needed(table[r], table.reshape(-1), b)
        for step, schedule in enumerate(ring):
            assert _listed(schedule, r) == _needed(table[r], table[(r - step) % cp], b)
    if layout == dcp.Zigzag():
        assert set(gathered.counts) == {(2 * cp - 1) * m * m + m * (m + 1)}
        assert set(ring[0].counts) == {2 * m * m + m}
        assert all(set(s.counts) == {2 * m * m} for s in ring[1:])


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_position_table_matches_layout(cp, layout):
    layout = LAYOUTS[layout]
    t = 8
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    got = jax.jit(
        jax.shard_map(
            lambda: layout.positions(t, "cp")[None], mesh=mesh, in_specs=(), out_specs=P("cp")
        )
    )()
    np.testing.assert_array_equal(np.asarray(got), layout.position_table(t, cp))
    # Independently: the global order that sharding `to_layout`'s result hands each rank.
    ordered = layout.to_layout(np.arange(cp * t)[None], cp)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ordered).reshape(cp, t))


# ---------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------


def _temp_bytes(attn, t_local: int, cp: int, layout, kv_exchange: str, grad: bool) -> int:
    params, static = eqx.partition(attn, eqx.is_array)

    context = None if cp == 1 else dcp.ContextParallel("cp", layout=layout)

    def local(params, x):
        out = eqx.combine(params, static)(x, cp=context, kv_schedule=kv_exchange)
        return jnp.sum(out) if grad else out

    fn = jax.grad(local, argnums=(0, 1)) if grad else local
    shape = (t_local * cp, HIDDEN)
    if cp == 1:
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
    else:
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        out_specs = (P(), P("cp")) if grad else P("cp")
        fn = jax.shard_map(fn, mesh=mesh, in_specs=(P(), P("cp")), out_specs=out_specs)
        x = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P("cp")))
    memory = jax.jit(fn).lower(params, x).compile().memory_analysis()
    assert memory is not None
    return memory.temp_size_in_bytes


@pytest.mark.parametrize(
    "cp, layout, kv_exchange, grad",
    [
        (1, "contiguous", "allgather", True),
        (2, "zigzag", "allgather", True),
        (2, "zigzag", "ring", False),
        (2, "zigzag", "ring", True),
        pytest.param(1, "contiguous", "allgather", False, marks=pytest.mark.slow),
        pytest.param(2, "zigzag", "allgather", False, marks=pytest.mark.slow),
        pytest.param(4, "contiguous", "allgather", True, marks=pytest.mark.slow),
        pytest.param(4, "contiguous", "ring", True, marks=pytest.mark.slow),
    ],
)
def test_memory_is_linear(cp, layout, kv_exchange, grad):
    # 4x the tokens, ~4x the temporary memory (the score matrices would make it 16x):
    # nothing but one tile per head of the scores is ever held, forward or backward. From 256
    # local tokens on: XLA:CPU's YNNPACK fusions pick another working buffer for the backward
    # between 128 and 256 tokens (a step of ~15%, then linear again).
    attn = _attn(8)
    small, large = (
        _temp_bytes(attn, t, cp, LAYOUTS[layout], kv_exchange, grad) for t in (256, 1024)
    )
    assert large <= 4.2 * small, (small, large)


@pytest.mark.parametrize(
    "layout, grad",
    [
        ("zigzag", True),
        pytest.param("zigzag", False, marks=pytest.mark.slow),
        pytest.param("contiguous", True, marks=pytest.mark.slow),
        pytest.param("contiguous", False, marks=pytest.mark.slow),
    ],
)
def test_ring_memory_is_per_rank(layout, grad):
    # The ring holds one piece of keys and values at a time (its steps are a loop), and its
    # backward saves only the local inputs, output and log-sum-exp (running the ring again
    # with the gradients of the keys and values): its memory per local token does not grow
    # with cp, O(S / cp) per rank where the all-gather's is O(S).
    attn = _attn(8)
    t = 256
    per_rank = {cp: _temp_bytes(attn, t, cp, LAYOUTS[layout], "ring", grad) for cp in (4, 8)}
    assert per_rank[8] <= 1.3 * per_rank[4], per_rank


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------


def test_tile_size_must_divide(getkey):
    attn = CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, tile_size=8, key=getkey())
    with pytest.raises(ValueError, match="tile_size=6"):
        attn(jnp.zeros((12, HIDDEN)))
    with pytest.raises(ValueError, match="positive int"):
        CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, tile_size=0, key=getkey())


def test_zigzag_pieces_must_be_whole_tiles(getkey):
    attn = CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, tile_size=4, key=getkey())
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    fn = jax.shard_map(
        lambda x: attn(x, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag())),
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=P("cp"),
    )
    x = jax.ShapeDtypeStruct((24, HIDDEN), jnp.float32, sharding=NamedSharding(mesh, P("cp")))
    with pytest.raises(ValueError, match="each of a rank's 2 pieces"):
        jax.jit(fn).lower(x)


def test_unknown_kv_schedule(getkey, without_runtime_typecheck):
    attn = CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, key=getkey())
    with pytest.raises(ValueError, match="kv_schedule='allgather'"):
        attn(jnp.zeros((8, HIDDEN)), kv_schedule="ppermute")  # pyright: ignore[reportArgumentType]


def test_bad_cp(getkey, without_runtime_typecheck):
    # `cp` is a ContextParallel without a mesh: the layer runs inside the user's shard_map.
    attn = CausalSelfAttention(HIDDEN, HEADS, HEAD_DIM, key=getkey())
    x = jnp.zeros((8, HIDDEN))
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    cache = attn.init_cache(8)
    for call in (attn, lambda x, cp: attn.prefill(x, cache, 0, cp=cp)):
        with pytest.raises(TypeError, match="must be a deltanet_cp.ContextParallel"):
            call(x, cp="cp")  # pyright: ignore[reportArgumentType]
        with pytest.raises(ValueError, match="takes no `mesh`"):
            call(x, cp=dcp.ContextParallel("cp", mesh=mesh))


def _busiest_rank_tiles(s: int, cp: int, layout, kv_exchange: str, block_size: int) -> int:
    """The tiles the busiest rank's forward computes (every loop, every run)."""
    _, m = tiling(layout, s // cp, cp, block_size)
    loops = tile_loops(layout.held(cp), m, kv_exchange)
    return max(sum(run.counts[r] for loop in loops for run in loop) for r in range(cp))


def test_busiest_rank_work():
    # The tile count of the schedule, against the formulas: under zigzag every rank runs
    # (2 cp - 1) m^2 + m (m + 1) tiles of b x b (m tiles per piece), under contiguous the
    # last rank runs m (m + 1) / 2 + (cp - 1) m^2, with either exchange.
    s, cp, b = 4096, 4, 64
    ideal = s * (s + 1) / 2 / cp
    m = s // (2 * cp) // b
    zig = (2 * cp - 1) * m * m + m * (m + 1)
    m = s // cp // b
    con = m * (m + 1) // 2 + (cp - 1) * m * m
    for kv in ("allgather", "ring"):
        assert _busiest_rank_tiles(s, cp, dcp.Zigzag(), kv, b) == zig
        assert _busiest_rank_tiles(s, cp, dcp.Contiguous(), kv, b) == con
    assert zig * b * b / ideal <= 1.02 and con * b * b / ideal >= 1.7


# ---------------------------------------------------------------------------------------
# Qwen3.5's attention: grouped-query, gated, q/k norms, partial RoPE; the KV cache
# ---------------------------------------------------------------------------------------


def _qwen_attn(block_size: int = 4) -> CausalSelfAttention:
    attn = CausalSelfAttention(
        HIDDEN,
        4,
        8,
        num_kv_heads=2,
        rotary_dim=4,
        output_gate=True,
        qk_norm=True,
        tile_size=block_size,
        key=jr.key(7),
    )
    assert attn.q_norm is not None and attn.k_norm is not None
    norms = (0.3 * jr.normal(jr.key(8), (2, 8))).astype(jnp.float32)
    return eqx.tree_at(lambda a: (a.q_norm.weight, a.k_norm.weight), attn, (norms[0], norms[1]))


def qwen_reference(attn: CausalSelfAttention, x, start: int = 0) -> np.ndarray:
    """Grouped-query attention with an output gate, zero-centred q/k RMSNorms and RoPE on
    the first `rotary_dim` features, one query at a time, float64 numpy; the tokens at
    positions `start ..` (the keys of earlier positions are not seen)."""
    x = np.asarray(x, np.float64)
    t, h, kvh, d, rd = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.rotary_dim
    wq, wk, wv, wo = _weights(attn)
    qg = (x @ wq.T).reshape(t, h, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, h * d)
    k, v = (x @ wk.T).reshape(t, kvh, d), (x @ wv.T).reshape(t, kvh, d)
    assert attn.q_norm is not None and attn.k_norm is not None

    def norm(y, w):
        w = np.asarray(w, np.float64)
        return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-6) * (1 + w)

    q, k = norm(q, attn.q_norm.weight), norm(k, attn.k_norm.weight)
    half = rd // 2
    freq = attn.rope_theta ** (-np.arange(half) / half)

    def rope(y, pos):
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        y1, y2 = y[:, :half], y[:, half:rd]
        return np.concatenate([y1 * c - y2 * s, y2 * c + y1 * s, y[:, rd:]], -1)

    keys = np.stack([rope(k[j], start + j) for j in range(t)])
    out = np.zeros((t, h, d))
    for i in range(t):
        qi = rope(q[i], start + i)
        for head in range(h):
            kv_head = head // (h // kvh)
            s = keys[: i + 1, kv_head] @ qi[head] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ v[: i + 1, kv_head]
    out = out.reshape(t, h * d) / (1 + np.exp(-gate))
    return out @ wo.T


def test_qwen_attention_matches_numpy():
    attn = _qwen_attn()
    x, _ = _inputs(24)
    out = jax.jit(lambda a, x: a(x))(attn, x)
    assert rel_err(out, qwen_reference(attn, x)) <= 1e-5


@pytest.mark.parametrize(
    "cp, layout, kv_exchange",
    [
        (4, "zigzag", "ring"),
        pytest.param(2, "contiguous", "allgather", marks=pytest.mark.slow),
        pytest.param(4, "zigzag", "allgather", marks=pytest.mark.slow),
        pytest.param(2, "contiguous", "ring", marks=pytest.mark.slow),
    ],
)
def test_qwen_attention_context_parallel(cp, layout, kv_exchange):
    # Grouped queries are rows of their key head's tiles: the same output and gradients
    # on cp ranks as on one device.
    attn = _qwen_attn()
    x, w = _inputs(32)
    out1, grads1 = _run_single(attn, x, w)
    out, grads = _run_cp(attn, x, w, cp, LAYOUTS[layout], kv_exchange)
    assert rel_err(out, out1) <= 1e-5
    assert max(rel_err(g, e) for g, e in zip(grads, grads1)) <= 1e-5


def test_kv_cache_prefill_and_steps():
    # A prefill into an empty cache, a second prefill from it, then one token at a time:
    # every output equals the one-pass output of the whole sequence, and the first
    # prefill's cache continued is the second's.
    attn = _qwen_attn()
    x, _ = _inputs(20)
    full = np.asarray(jax.jit(lambda a, x: a(x))(attn, x))
    cache = attn.init_cache(24)
    prefill = jax.jit(lambda a, x, c, n: a.prefill(x, c, n))
    out_a, cache = prefill(attn, x[:8], cache, 0)
    out_b, cache = prefill(attn, x[8:16], cache, 8)
    step = jax.jit(lambda a, x, c, n: a.step(x, c, n))
    rows = []
    for i in range(16, 20):
        y, cache = step(attn, x[i], cache, i)
        rows.append(y)
    got = np.concatenate([out_a, out_b, np.stack(rows)])
    assert rel_err(got, full) <= 1e-5
    assert rel_err(qwen_reference(attn, x[:8]), full[:8]) <= 1e-5
    _, direct = prefill(attn, x, attn.init_cache(24), 0)
    assert rel_err(cache.k[:20], direct.k[:20]) <= 1e-6
    assert rel_err(cache.v[:20], direct.v[:20]) <= 1e-6


@pytest.mark.parametrize(
    "cp, layout, kv_exchange",
    [
        pytest.param(4, "zigzag", "ring", marks=pytest.mark.slow),
        pytest.param(2, "contiguous", "allgather", marks=pytest.mark.slow),
    ],
)
def test_kv_cache_prefill_context_parallel(cp, layout, kv_exchange):
    # A prefill under context parallelism from a cache filled on one device: the outputs
    # and the new cache (gathered in sequence order on every rank) equal one device's.
    attn = _qwen_attn()
    x, _ = _inputs(40)
    prefill = jax.jit(lambda a, x, c, n: a.prefill(x, c, n))
    _, cache = prefill(attn, x[:8], attn.init_cache(48), 0)
    want, want_cache = prefill(attn, x[8:], cache, 8)
    layout = LAYOUTS[layout]
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(attn, eqx.is_array)

    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, x, cache):
        a = eqx.combine(params, static)
        return a.prefill(x, cache, 8, cp=context, kv_schedule=kv_exchange)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp"), P()), out_specs=(P("cp"), P()))
    new = layout.to_layout(x[8:], cp, axis=0)
    out, got_cache = jax.jit(f)(params, jax.device_put(new, NamedSharding(mesh, P("cp"))), cache)
    out = layout.from_layout(out, cp, axis=0)
    assert rel_err(out, want) <= 1e-5
    assert rel_err(got_cache.k, want_cache.k) <= 1e-6
    assert rel_err(got_cache.v, want_cache.v) <= 1e-6

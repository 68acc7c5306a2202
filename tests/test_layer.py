"""The Gated DeltaNet layer: against a float64 numpy re-implementation, generation, CP."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn import CausalConv1d, GatedDeltaNet, RecurrentLayerState

from .helpers import gated_delta_reference, rel_err


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


# hidden, H, HV, K, V: grouped value heads (r = 2) and K != V.
SIZES = (32, 2, 4, 8, 4)


def _np(x):
    return np.asarray(x, dtype=np.float64)


def _silu(x):
    return x / (1 + np.exp(-x))


def _conv_reference(w, x, state):
    """torch's depthwise Conv1d (cross-correlation) with `state` as the left padding."""
    xp = np.concatenate([state, x], axis=0)
    return np.stack(
        [np.convolve(xp[:, c], w[c, ::-1], mode="valid") for c in range(x.shape[1])], axis=1
    )


def layer_reference(layer: GatedDeltaNet, x, state: RecurrentLayerState | None = None):
    """The whole layer in float64 numpy, written from DESIGN.md section 5.

    **Returns:** `(out (T, hidden), conv state, recurrent state)`.
    """
    t = x.shape[0]
    h, hv, dk, dv = (
        layer.num_key_heads,
        layer.num_value_heads,
        layer.key_head_dim,
        layer.value_head_dim,
    )
    x = _np(x)
    mixed = x @ _np(layer.in_proj_qkv.weight).T
    z = (x @ _np(layer.in_proj_z.weight).T).reshape(t, hv, dv)
    b = x @ _np(layer.in_proj_b.weight).T
    a = x @ _np(layer.in_proj_a.weight).T
    hist = layer.conv_kernel_size - 1
    conv0 = np.zeros((hist, mixed.shape[1])) if state is None else _np(state.conv)
    conv = _silu(_conv_reference(_np(layer.conv1d.weight), mixed, conv0))
    q = conv[:, : h * dk].reshape(t, h, dk)
    k = conv[:, h * dk : 2 * h * dk].reshape(t, h, dk)
    v = conv[:, 2 * h * dk :].reshape(t, hv, dv)
    beta = 1 / (1 + np.exp(-b))
    g = -np.exp(_np(layer.A_log)) * np.log1p(np.exp(a + _np(layer.dt_bias)))
    h0 = None if state is None else _np(state.recurrent)[None]
    o, hT = gated_delta_reference(
        q[None], k[None], v[None], g[None], beta[None], initial_state=h0, l2norm=True
    )
    o = o[0]
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + layer.norm.eps)
    o = o * _np(layer.norm.weight) * _silu(z)
    out = o.reshape(t, hv * dv) @ _np(layer.out_proj.weight).T
    new_conv = np.concatenate([conv0, mixed], axis=0)[-hist:]
    return out, new_conv, hT[0]


def with_slow_decays(layer: GatedDeltaNet, key) -> GatedDeltaNet:
    """Per-head decay rates `exp(A_log)` spread log-uniformly over [0.02, 16] (and
    `dt_bias = -1`), so some heads remember for hundreds of tokens.

    The default init, `A_log = log U(1, 16)` and `dt_bias = 1`, forgets within a few tokens:
    a broken hand-off of state between chunks or ranks would go unnoticed.
    """
    hv = layer.num_value_heads
    edges = jnp.linspace(jnp.log(0.02), jnp.log(16.0), hv + 1)
    a_log = edges[:-1] + jr.uniform(key, (hv,)) * (edges[1:] - edges[:-1])
    return eqx.tree_at(lambda m: (m.A_log, m.dt_bias), layer, (a_log, -jnp.ones(hv)))


def _random_state(layer: GatedDeltaNet, key, batch=()):
    kc, kr = jr.split(key)
    s = layer.init_state()
    return RecurrentLayerState(
        conv=jr.normal(kc, batch + s.conv.shape),
        recurrent=0.5 * jr.normal(kr, batch + s.recurrent.shape),
    )


def _mesh(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


# ------------------------------------------------------------------------------------------------
# single device
# ------------------------------------------------------------------------------------------------
def test_init(getkey):
    layer = GatedDeltaNet(*SIZES, key=getkey())
    hidden, h, hv, dk, dv = SIZES
    conv_dim = 2 * h * dk + hv * dv
    assert layer.conv_dim == conv_dim
    assert layer.in_proj_qkv.weight.shape == (conv_dim, hidden)
    assert layer.in_proj_z.weight.shape == (hv * dv, hidden)
    assert layer.in_proj_b.weight.shape == layer.in_proj_a.weight.shape == (hv, hidden)
    assert layer.conv1d.weight.shape == (conv_dim, 4)
    assert layer.out_proj.weight.shape == (hidden, hv * dv)
    big = GatedDeltaNet(8, 1, 64, 2, 2, key=getkey())
    a = np.exp(np.asarray(big.A_log))
    assert a.min() >= 1 and a.max() <= 16 and a.max() - a.min() > 10  # log U(1, 16)
    np.testing.assert_array_equal(big.dt_bias, 1.0)
    np.testing.assert_array_equal(layer.norm.weight, 1.0)
    s = layer.init_state()
    assert s.conv.shape == (3, conv_dim) and s.recurrent.shape == (hv, dk, dv)
    assert s.recurrent.dtype == jnp.float32
    with pytest.raises(ValueError, match="multiple of"):
        GatedDeltaNet(32, 3, 4, 8, 8, key=getkey())


@pytest.mark.parametrize("with_state", [False, True])
def test_conv_matches_numpy(getkey, with_state):
    conv = CausalConv1d(5, 4, key=getkey())
    x = jr.normal(getkey(), (11, 5))
    state = jr.normal(getkey(), (3, 5)) if with_state else None
    y, new = conv(x, state)
    s0 = np.zeros((3, 5)) if state is None else _np(state)
    expected = _conv_reference(_np(conv.weight), _np(x), s0)
    assert rel_err(y, expected) <= 1e-6
    np.testing.assert_array_equal(new, np.concatenate([s0, _np(x)])[-3:].astype(np.float32))
    # Fewer tokens than the window: the state slides.
    y2, new2 = conv(x[:2], state)
    assert rel_err(y2, expected[:2]) <= 1e-6
    np.testing.assert_array_equal(new2, np.concatenate([s0, _np(x[:2])])[-3:].astype(np.float32))


def test_layer_matches_float64_reference(getkey):
    """With a state in and out (zero states: see the CP and Hugging Face tests)."""
    layer = with_slow_decays(GatedDeltaNet(*SIZES, chunk_size=16, key=getkey()), getkey())
    x = jr.normal(getkey(), (50, SIZES[0]))
    state = _random_state(layer, getkey())
    out, new, _ = eqx.filter_jit(lambda m, x, s: m.prefill(x, s))(layer, x, state)
    expected, conv_state, rec_state = layer_reference(layer, x, state)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, expected) <= 1e-5
    assert rel_err(new.conv, conv_state) <= 1e-6
    assert rel_err(new.recurrent, rec_state) <= 1e-5
    np.testing.assert_array_equal(eqx.filter_jit(lambda m, x, s: m(x, s))(layer, x, state), out)


# Cost: one compiled program (one device; the sharded path is test_layers_kinds.py's).
def test_packed_documents_match_float64_reference(getkey):
    """`cu_seqlens`: each document as its own call from zeros, the float64 layer per
    document (the shared path of every recurrent layer, here on Qwen3-Next's mixer)."""
    layer = with_slow_decays(GatedDeltaNet(*SIZES, chunk_size=16, key=getkey()), getkey())
    x = jr.normal(getkey(), (50, SIZES[0]))
    cu = [0, 2, 21, 21, 50]  # a document shorter than the kernel, an empty one
    out = eqx.filter_jit(lambda m, x: m(x, cu_seqlens=cu))(layer, x)
    docs = [layer_reference(layer, x[s:e])[0] for s, e in zip(cu[:-1], cu[1:]) if e > s]
    assert rel_err(out, np.concatenate(docs)) <= 1e-5


def test_block_size_reaches_the_engine(getkey):
    """`block_size` is the engine's block (the `block_size` of `deltanet_cp.run`): blocks of
    one chunk put the factor work in a loop over blocks, which a block holding the 50 tokens
    whole has not; the results equal the float64 reference at every size (`None`: the
    backend's default)."""
    kp, kd, kx = getkey(), getkey(), getkey()
    x = jr.normal(kx, (50, SIZES[0]))
    whiles = {}
    for block in (None, 8, 64):
        layer = GatedDeltaNet(*SIZES, chunk_size=8, block_size=block, key=kp)
        layer = with_slow_decays(layer, kd)
        assert layer.block_size == block
        params, static = eqx.partition(layer, eqx.is_array)
        forward = jax.jit(lambda p, x: eqx.combine(p, static)(x))
        assert rel_err(forward(params, x), layer_reference(layer, x)[0]) <= 1e-5
        whiles[block] = forward.lower(params, x).as_text().count("stablehlo.while")
    assert whiles[8] == whiles[64] + 1
    with pytest.raises(ValueError, match="`block_size` must be a positive int"):
        GatedDeltaNet(*SIZES, block_size=0, key=getkey())


def test_memory_reaches_the_engine(getkey, without_runtime_typecheck):
    """`memory="high"` is the `memory` of `deltanet_cp.run`: the backward keeps every
    chunk's factors, so the compiled gradient holds more temporaries than at `"low"` (blocks
    of one chunk) and forms no factor twice (fewer matmuls); the gradients agree. ~4 s."""
    kp, kd, kx = getkey(), getkey(), getkey()
    x = jr.normal(kx, (50, SIZES[0]))
    grads, temps, dots = {}, {}, {}
    for memory in ("low", "high"):
        layer = GatedDeltaNet(*SIZES, chunk_size=8, block_size=8, memory=memory, key=kp)
        layer = with_slow_decays(layer, kd)
        assert layer.memory == memory
        params, static = eqx.partition(layer, eqx.is_array)
        grad = jax.jit(jax.grad(lambda p, x: jnp.sum(eqx.combine(p, static)(x) ** 2)))
        compiled = grad.lower(params, x).compile()
        stats, text = compiled.memory_analysis(), compiled.as_text()
        assert stats is not None and text is not None
        temps[memory] = stats.temp_size_in_bytes
        dots[memory] = text.count(" dot(")
        grads[memory] = compiled(params, x)
    assert temps["high"] > temps["low"] and dots["high"] < dots["low"], (temps, dots)
    for high, low in zip(jax.tree.leaves(grads["high"]), jax.tree.leaves(grads["low"])):
        assert rel_err(high, low) <= 1e-5
    with pytest.raises(ValueError, match='`memory` must be "low"'):
        GatedDeltaNet(*SIZES, memory="all", key=getkey())  # pyright: ignore[reportArgumentType]


def test_precision_policy(getkey, monkeypatch, without_runtime_typecheck):
    """`precision` reaches the gated delta rule in the chunked pass and in `step`; on
    float32 parameters the default (`None`) is `"highest"`, bit for bit."""
    from deltanet_cp.nn import _delta_layer

    key, x = getkey(), jr.normal(getkey(), (40, SIZES[0]))
    outs, steps = {}, {}
    for precision in (None, "highest"):
        layer = GatedDeltaNet(*SIZES, chunk_size=8, precision=precision, key=key)
        assert layer.precision == precision
        outs[precision] = eqx.filter_jit(lambda m, x: m(x))(layer, x)
        steps[precision] = eqx.filter_jit(lambda m, x, s: m.step(x, s))(
            layer, x[0], layer.init_state()
        )
    np.testing.assert_array_equal(outs[None], outs["highest"])
    for a, b in zip(jax.tree.leaves(steps[None]), jax.tree.leaves(steps["highest"])):
        np.testing.assert_array_equal(a, b)

    seen = []
    real = _delta_layer.run

    def spy(recurrence, *args, **kwargs):
        seen.append(recurrence.precision)
        return real(recurrence, *args, **kwargs)

    monkeypatch.setattr(_delta_layer, "run", spy)
    layer = GatedDeltaNet(*SIZES, chunk_size=8, precision="bfloat16", key=key)
    jax.eval_shape(layer, x)
    jax.eval_shape(layer.step, x[0], layer.init_state())
    assert seen == ["bfloat16", "bfloat16"]
    with pytest.raises(ValueError, match="`precision` must be one of"):
        GatedDeltaNet(*SIZES, precision="float8", key=key)  # pyright: ignore[reportArgumentType]


def test_float64_layer(getkey):
    with jax.enable_x64(True):
        layer = GatedDeltaNet(*SIZES, chunk_size=16, key=getkey(), dtype=jnp.float64)
        x = jr.normal(getkey(), (40, SIZES[0]), jnp.float64)
        out = eqx.filter_jit(lambda m, x: m(x))(layer, x)
        assert out.dtype == jnp.float64
        assert rel_err(out, layer_reference(layer, x)[0]) <= 1e-10


def test_output_dtype_is_x_dtype(getkey):
    """What the docstring says (issue 19, item 8): the layer computes in its parameters' dtype
    and returns `x`'s, where a bfloat16 `x` through float32 parameters gave float32."""
    layer = GatedDeltaNet(*SIZES, chunk_size=16, key=getkey())
    x = jr.normal(getkey(), (20, SIZES[0])).astype(jnp.bfloat16)
    call = eqx.filter_jit(lambda m, x, s: m.prefill(x, s)[:2])
    out, state = call(layer, x, None)
    assert out.dtype == jnp.bfloat16
    assert state.conv.dtype == jnp.float32 and state.recurrent.dtype == jnp.float32
    # The float32 computation of the same values, rounded once at the end.
    expected, _ = call(layer, x.astype(jnp.float32), None)
    assert rel_err(out, expected) <= 2**-8
    # The token-by-token form, and a state carried in another dtype keeps its dtype.
    y, new = eqx.filter_jit(GatedDeltaNet.step)(layer, x[0], layer.init_state(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and y.shape == (SIZES[0],)
    assert new.conv.dtype == jnp.bfloat16 and new.recurrent.dtype == jnp.float32
    # bfloat16 parameters (the tests promote dtypes strictly: no silent mixing inside).
    half = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if eqx.is_inexact_array(a) else a, layer)
    assert call(half, x, None)[0].dtype == jnp.bfloat16
    assert call(half, x.astype(jnp.float32), None)[0].dtype == jnp.float32


def test_prefill_then_decode(getkey):
    """Prefill + token-by-token steps == one call over the whole sequence (and its state)."""
    layer = with_slow_decays(GatedDeltaNet(*SIZES, chunk_size=16, key=getkey()), getkey())
    x = jr.normal(getkey(), (30, SIZES[0]))
    call = eqx.filter_jit(lambda m, x: m.prefill(x)[:2])
    full, full_state = call(layer, x)
    y, state = call(layer, x[:19])
    outs = [y]
    step = eqx.filter_jit(GatedDeltaNet.step)
    for t in range(19, 30):
        y_t, state = step(layer, x[t], state)
        outs.append(y_t[None])
    assert rel_err(jnp.concatenate(outs), full) <= 1e-5
    assert rel_err(state.recurrent, full_state.recurrent) <= 1e-5
    np.testing.assert_allclose(state.conv, full_state.conv, rtol=1e-5, atol=1e-6)
    # From the very first token, starting at init_state().
    y0, _ = step(layer, x[0], layer.init_state())
    assert rel_err(y0, full[0]) <= 1e-5


def test_bad_cp(getkey, without_runtime_typecheck):
    # `cp` is a ContextParallel without a mesh (the layer runs inside the user's
    # shard_map), on every entry point.
    layer = GatedDeltaNet(*SIZES, key=getkey())
    x = jr.normal(getkey(), (8, SIZES[0]))
    with_mesh = dcp.ContextParallel("cp", mesh=_mesh(2))
    for call in (layer, layer.prefill, layer.recurrence_inputs):
        with pytest.raises(TypeError, match="must be a deltanet_cp.ContextParallel"):
            call(x, cp="cp")  # pyright: ignore[reportArgumentType]
        with pytest.raises(ValueError, match="takes no `mesh`"):
            call(x, cp=with_mesh)


def test_errors(getkey):
    layer = GatedDeltaNet(*SIZES, key=getkey())
    x = jr.normal(getkey(), (8, SIZES[0]))
    mesh = _mesh(4)
    f = jax.shard_map(
        lambda x: layer(x, cp=dcp.ContextParallel("cp")),
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=P("cp"),
    )
    with pytest.raises(ValueError, match="at least kernel_size - 1 = 3 tokens"):
        f(jax.device_put(x, NamedSharding(mesh, P("cp"))))


# ------------------------------------------------------------------------------------------------
# context parallelism
# ------------------------------------------------------------------------------------------------
B, T = 2, 64


@ft.cache
def _cp_problem():
    keys = jr.split(jr.key(1234), 6)
    layer = with_slow_decays(GatedDeltaNet(*SIZES, chunk_size=8, key=keys[0]), keys[5])
    x = jr.normal(keys[1], (B, T, SIZES[0]))
    state = _random_state(layer, keys[2], (B,))
    w_out = jr.normal(keys[3], x.shape)
    w_state = _random_state(layer, keys[4], (B,))
    return layer, x, state, w_out, w_state


def _cp_apply(cp: int, exchange, layout: Any = dcp.Contiguous()):
    """`(apply, x, w_out)`: `apply(params, x, state) -> (y, new_state)` at CP degree `cp`
    (`cp == 1`: the single-device path), and the sequence-shaped inputs placed for it (in
    zigzag order under `Zigzag`: `y` comes back in that order too)."""
    layer, x, _, w_out, _ = _cp_problem()
    static = eqx.partition(layer, eqx.is_array)[1]

    def apply(params, x, state, context=None):
        m = eqx.combine(params, static)
        return jax.vmap(lambda x, s: m.prefill(x, s, cp=context)[:2])(x, state)

    if cp == 1:
        return apply, x, w_out
    x, w_out = layout.to_layout(x, cp), layout.to_layout(w_out, cp)
    mesh = _mesh(cp)
    seq = P(None, "cp")
    sharded = jax.shard_map(
        ft.partial(apply, context=dcp.ContextParallel("cp", layout=layout, exchange=exchange)),
        mesh=mesh,
        in_specs=(P(), seq, P()),
        out_specs=(seq, P()),
    )
    place = ft.partial(jax.device_put, device=NamedSharding(mesh, seq))
    return sharded, place(x), place(w_out)


def _cp_loss_and_grads(cp: int, exchange="allgather", layout: Any = dcp.Contiguous()):
    """Output, final state, and grads of a loss of both w.r.t. parameters, input and state
    (output and input gradient in sequence order)."""
    layer, _, state, _, w_state = _cp_problem()
    apply, x, w_out = _cp_apply(cp, exchange, layout)

    def loss(params, x, state):
        y, new = apply(params, x, state)
        total = jnp.sum(y * w_out) + jnp.sum(new.conv * w_state.conv)
        return total + jnp.sum(new.recurrent * w_state.recurrent), (y, new)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    grads, (y, new) = grad(eqx.filter(layer, eqx.is_array), x, state)
    y = layout.from_layout(y, cp)
    grads = (grads[0], layout.from_layout(grads[1], cp), grads[2])
    return y, new, grads


def _cp_forward(cp: int, exchange):
    layer, _, state, _, _ = _cp_problem()
    apply, x, _ = _cp_apply(cp, exchange)
    return jax.jit(apply)(eqx.filter(layer, eqx.is_array), x, state)


@ft.cache
def _cp1():
    return _cp_loss_and_grads(1)


def _max_leaf_err(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(rel_err, a, b)))


def test_cp_problem_depends_on_the_carried_state():
    """The CP problem is sensitive to a wrong hand-off: the second half of the sequence
    computed from zero states (conv and recurrent) is far from the true output."""
    y1, _, _ = _cp1()
    layer, x, *_ = _cp_problem()
    tail = jax.jit(jax.vmap(layer))(x[:, T // 2 :])
    assert rel_err(tail, y1[:, T // 2 :]) > 1e-2


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_invariance(cp):
    """Outputs, final state and all gradients at cp = 2, 4, 8 equal cp = 1 (single device)."""
    y1, new1, grads1 = _cp1()
    layer, x, state, *_ = _cp_problem()
    # The cp = 1 path itself against the float64 reference, for one batch element.
    expected, conv_ref, rec_ref = layer_reference(layer, x[0], jax.tree.map(lambda s: s[0], state))
    assert rel_err(y1[0], expected) <= 1e-5 and rel_err(new1.recurrent[0], rec_ref) <= 1e-5
    assert rel_err(new1.conv[0], conv_ref) <= 1e-6

    y, new, grads = _cp_loss_and_grads(cp)
    assert rel_err(y, y1) <= 1e-5
    assert _max_leaf_err(new, new1) <= 1e-5
    errs = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


@pytest.mark.parametrize(
    "cp, exchange",
    # `slow`: tests/test_hybrid.py runs the layer (and its convolution) on zigzag shards
    # in the default run, with every gradient.
    [
        pytest.param(2, "ring", marks=pytest.mark.slow),
        pytest.param(4, "allgather", marks=pytest.mark.slow),
        pytest.param(8, "ppermute", marks=pytest.mark.slow),
    ],
)
def test_zigzag_invariance(cp, exchange):
    """On zigzag shards (the convolution's halo and the recurrence follow the chain): the
    outputs, final state and all gradients equal one device's."""
    y1, new1, grads1 = _cp1()
    y, new, grads = _cp_loss_and_grads(cp, exchange, dcp.Zigzag())
    assert rel_err(y, y1) <= 1e-5
    assert _max_leaf_err(new, new1) <= 1e-5
    errs = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


@pytest.mark.parametrize("exchange", ["ppermute", "ring"])
def test_cp_exchanges(exchange):
    """The other state exchanges (forward: the kernel's own tests cover their gradients)."""
    y1, new1, _ = _cp1()
    y, new = _cp_forward(4, exchange)
    assert rel_err(y, y1) <= 1e-5
    assert _max_leaf_err(new, new1) <= 1e-5


@pytest.mark.parametrize("exchange", ["allgather", "ppermute", "ring"])
def test_hlo_one_conv_halo(getkey, exchange):
    """One collective-permute of B x (W - 1) x conv_dim for the conv; the state exchange is the
    only other communication (for "allgather": one all-gather of every rank's (M, U))."""
    cp, b, t = 4, 2, 32
    hidden, h, hv, dk, dv = SIZES
    layer = GatedDeltaNet(*SIZES, chunk_size=8, key=getkey())
    halo = b * (layer.conv_kernel_size - 1) * layer.conv_dim
    state_elems = b * hv * dk * dv
    assert halo != state_elems and halo != b * hv * dk * dk  # so the count below is unambiguous
    mesh = _mesh(cp)
    seq = P(None, "cp")
    context = dcp.ContextParallel("cp", exchange=exchange)
    f = jax.shard_map(
        lambda x: jax.vmap(ft.partial(layer, cp=context))(x),
        mesh=mesh,
        in_specs=seq,
        out_specs=seq,
    )
    x = jax.device_put(jr.normal(getkey(), (b, t, hidden)), NamedSharding(mesh, seq))
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert hlo is not None
    found = dcp.internal.collectives(hlo)

    permutes = [c for c in found if c.kind == "collective-permute"]
    halos = [c for c in permutes if c.elements == halo]
    assert len(halos) == 1, found
    assert sorted(halos[0].received) == [1, 2, 3]  # rank 0 receives nothing
    gathers = [c for c in found if c.kind == "all-gather"]
    if exchange == "allgather":
        assert len(permutes) == 1, found
        assert sum(c.elements for c in gathers) == cp * b * hv * dk * (dk + dv), found
        assert {c.kind for c in found} == {"collective-permute", "all-gather"}, found
    else:
        assert not gathers, found
        assert {c.kind for c in found} == {"collective-permute"}, found

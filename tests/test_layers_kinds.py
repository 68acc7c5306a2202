"""A layer for every kind: DeltaNet, gated linear attention (per key channel and per head),
Gated DeltaProduct, Gated DeltaNet-2, Momentum DeltaNet and the preconditioned Gated DeltaNet
and Kimi Delta Attention against float64 numpy re-implementations built on the token loops of
tests/helpers.py, RWKV-7's time mix against its own float64 token loop; prefill then decoding;
context parallelism (outputs, final state and every gradient equal one device's, both
layouts); `HybridLM` with a mixed pattern, and with
RWKV-7's `v_first` passed from its first RWKV-7 block to the later ones.

Costs are compile-dominated (tiny shapes): each check compiles one program per layer (the
CP check two: one device and the sharded one)."""

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
from deltanet_cp import nn

from .helpers import (
    delta_product_reference,
    delta_reference,
    gdn2_reference,
    gla_reference,
    momentum_reference,
    precond_reference,
    rel_err,
)
from .test_layer import _conv_reference, _silu


# Small programs: compiling dominates, and XLA's optimisations change nothing but rounding.
pytestmark = pytest.mark.usefixtures("fast_compile")

HIDDEN, CHUNK = 16, 8


def _slow_decays(layer):
    """Decay rates `exp(A_log)` (and the preconditioner's `exp(A_log_atk)`) spread over
    [0.02, 0.5], so the state carried between chunks and ranks matters (the default init
    forgets within a few tokens); the preconditioner's centres one per key head, apart."""
    for name in ("A_log", "A_log_atk"):
        if hasattr(layer, name):
            size, shape = getattr(layer, name).size, getattr(layer, name).shape
            rates = jnp.geomspace(0.02, 0.5, size).reshape(shape)
            layer = eqx.tree_at(lambda m: getattr(m, name), layer, jnp.log(rates))
    if hasattr(layer, "log_atk_scale"):
        centres = jnp.linspace(-0.5, 0.3, layer.log_atk_scale.size)
        layer = eqx.tree_at(lambda m: m.log_atk_scale, layer, centres)
    return layer


# name -> a layer with grouped value heads where the kind has them, K != V, chunks of 8.
FACTORIES = {
    "delta_net": lambda key: nn.DeltaNet(
        HIDDEN, 1, 2, 8, 4, allow_neg_eigval=True, chunk_size=CHUNK, key=key
    ),
    "gla": lambda key: nn.GatedLinearAttention(HIDDEN, 2, 8, 4, chunk_size=CHUNK, key=key),
    "simple_gla": lambda key: nn.SimpleGatedLinearAttention(
        HIDDEN, 2, 8, 4, chunk_size=CHUNK, key=key
    ),
    "gated_delta_product": lambda key: nn.GatedDeltaProduct(
        HIDDEN, 1, 2, 8, 4, num_householder=2, chunk_size=CHUNK, key=key
    ),
    "gdn2": lambda key: nn.GatedDeltaNet2(
        HIDDEN, 1, 2, 8, 4, allow_neg_eigval=True, chunk_size=CHUNK, key=key
    ),
    "momentum": lambda key: nn.MomentumDeltaNet(HIDDEN, 1, 2, 8, 4, chunk_size=CHUNK, key=key),
    "precond_gdn": lambda key: nn.PrecondGatedDeltaNet(
        HIDDEN, 2, 4, 8, 4, allow_neg_eigval=True, chunk_size=CHUNK, key=key
    ),
    "precond_kda": lambda key: nn.PrecondKimiDeltaAttention(
        HIDDEN, 2, 8, chunk_size=CHUNK, key=key
    ),
}
PRECOND = ("precond_gdn", "precond_kda")
KINDS = list(FACTORIES)


@ft.cache
def _layer(name: str):
    return _slow_decays(FACTORIES[name](jr.key(KINDS.index(name))))


# ------------------------------------------------------------------------------------------------
# the float64 re-implementations
# ------------------------------------------------------------------------------------------------
def _np(x):
    return np.asarray(x, np.float64)


def _lin(linear: eqx.nn.Linear, x):
    y = x @ _np(linear.weight).T
    return y if linear.bias is None else y + _np(linear.bias)


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0, x)


def _log_sigmoid(x):
    return -np.logaddexp(0, -x)


def _delta_net(layer, x, q, k, v, h0):
    beta = 2 * _sigmoid(_lin(layer.b_proj, x))
    o, h = delta_reference(q, k, v, beta[None], initial_state=h0, l2norm=True)
    return o, h, _lin(layer.g_proj, x), _silu


def _gla(layer, x, q, k, v, h0):
    g = _log_sigmoid(_lin(layer.gk_b_proj, _lin(layer.gk_a_proj, x))).reshape(k.shape)
    o, h = gla_reference(q, k, v, g / layer.gate_logit_normalizer, initial_state=h0)
    return o, h, _lin(layer.g_proj, x), _silu


def _simple_gla(layer, x, q, k, v, h0):
    g = _log_sigmoid(_lin(layer.gk_proj, x)) / layer.gate_logit_normalizer
    o, h = gla_reference(q, k, v, g[None], initial_state=h0)
    return o, h, _lin(layer.g_proj, x), _silu


def _decay(layer, a):
    return -np.exp(_np(layer.A_log)) * _softplus(a + _np(layer.dt_bias))


def _gated_delta_product(layer, x, q, k, v, h0):
    t, n = x.shape[0], layer.num_householder
    beta = 2 * _sigmoid(_lin(layer.b_proj, x)).reshape(t, n, -1)
    g = _decay(layer, _lin(layer.a_proj, x))
    o, h = delta_product_reference(q, k, v, g[None], beta[None], initial_state=h0, l2norm=True)
    return o, h, _lin(layer.g_proj, x), _silu


def _gdn2(layer, x, q, k, v, h0):
    t, (h, dk), r = x.shape[0], k.shape[2:], v.shape[2] // k.shape[2]
    f = _lin(layer.f_b_proj, _lin(layer.f_a_proj, x)).reshape(t, h, dk)
    g = -np.exp(_np(layer.A_log))[:, None] * _softplus(f + _np(layer.dt_bias))
    erase = 2 * _sigmoid(_lin(layer.b_proj, x)).reshape(t, h, dk)
    g, erase = (np.repeat(a, r, axis=1) for a in (g, erase))
    w = _sigmoid(_lin(layer.w_proj, x)).reshape(v.shape[1:])
    o, hT = gdn2_reference(q, k, v, g[None], erase[None], w[None], initial_state=h0, l2norm=True)
    return o, hT, _lin(layer.g_b_proj, _lin(layer.g_a_proj, x)), _sigmoid


def _momentum(layer, x, q, k, v, h0):
    r = v.shape[2] // k.shape[2]

    def per_value_head(p):
        return np.repeat(_np(p), r)

    a, b, m, e = (_lin(p, x) for p in (layer.a_proj, layer.b_proj, layer.m_proj, layer.e_proj))
    log_alpha = -np.exp(per_value_head(layer.A_log)) * _softplus(a + _np(layer.dt_bias))
    log_mu = -np.exp(per_value_head(layer.Mu_log)) * _softplus(m + _np(layer.mu_bias))
    eta = np.tanh(e / layer.tau) + 1
    theta = np.arctan(eta * np.exp(per_value_head(layer.log_factor)))
    beta = np.sin(theta) ** 2 * _sigmoid(b)
    log_alpha = np.log(np.cos(theta) ** 2) + log_alpha
    log_mu = np.maximum(log_mu, layer.min_log_mu)
    q = q - np.exp(_np(layer.D_log))[None, None, :, None] * k
    o, h = momentum_reference(
        q,
        k,
        v,
        log_alpha[None],
        log_mu[None],
        k,
        beta[None],
        eta[None],
        initial_state=h0,
        l2norm=True,
    )
    return o, h, _lin(layer.g_proj, x), _silu


def _preconditioned(layer, x, q, k, v, g, beta, h0, a0):
    """The preconditioner's gates from `x`, then the float64 preconditioned delta rule:
    `(o, (S, A))`."""
    a_atk, b_atk = _lin(layer.a_atk_proj, x), _lin(layer.b_atk_proj, x)
    g_atk = -np.exp(_np(layer.A_log_atk)) * _softplus(a_atk + _np(layer.dt_bias_atk))
    o, h, a = precond_reference(
        q,
        k,
        v,
        g_atk[None],
        g[None],
        _sigmoid(b_atk)[None],
        beta[None],
        initial_state=h0,
        initial_A_state=a0,
        l2norm=True,
        x=layer.squash_x,
        eps=layer.squash_eps,
        log_atk_scale=_np(layer.log_atk_scale),
    )
    return o, (h, a)


def _precond_gdn(layer, x, q, k, v, h0, a0):
    g, beta = _decay(layer, _lin(layer.a_proj, x)), 2 * _sigmoid(_lin(layer.b_proj, x))
    o, states = _preconditioned(layer, x, q, k, v, g, beta, h0, a0)
    return o, states, _lin(layer.g_proj, x), _silu


def _precond_kda(layer, x, q, k, v, h0, a0):
    f = _lin(layer.f_b_proj, _lin(layer.f_a_proj, x)).reshape(k.shape[1:])
    g = -np.exp(_np(layer.A_log))[:, None] * _softplus(f + _np(layer.dt_bias))
    beta = _sigmoid(_lin(layer.b_proj, x))
    o, states = _preconditioned(layer, x, q, k, v, g, beta, h0, a0)
    return o, states, _lin(layer.g_b_proj, _lin(layer.g_a_proj, x)), _sigmoid


REFERENCES = {
    "delta_net": _delta_net,
    "gla": _gla,
    "simple_gla": _simple_gla,
    "gated_delta_product": _gated_delta_product,
    "gdn2": _gdn2,
    "momentum": _momentum,
    "precond_gdn": _precond_gdn,
    "precond_kda": _precond_kda,
}


def _recurrent_parts(state) -> tuple:
    """The recurrent arrays of a layer's state: `(recurrent,)`, or `(recurrent, A)` for the
    preconditioned layers (the preconditioner's state)."""
    if isinstance(state, nn.PrecondLayerState):
        return state.recurrent, state.A
    return (state.recurrent,)


def _recurrent_err(state, expected: tuple) -> float:
    return max(rel_err(a, e) for a, e in zip(_recurrent_parts(state), expected, strict=True))


def layer_reference(name: str, layer, x, state):
    """The whole layer in float64 numpy: projections, the causal convolution and SiLU, the
    gates, the float64 token loop, the gated RMSNorm and the output projection.

    **Returns:** `(out (T, hidden), conv state, recurrent states)`, the last as
    `_recurrent_parts` lists them.
    """
    x, t = _np(x), x.shape[0]
    mixed = _lin(layer.in_proj_qkv, x)
    hist = layer.conv_kernel_size - 1
    conv0 = _np(state.conv)
    conv = _silu(_conv_reference(_np(layer.conv1d.weight), mixed, conv0))
    hv, _, dv = layer.init_state().recurrent.shape
    dk: int = getattr(layer, "key_head_dim", getattr(layer, "head_dim", 0))
    h: int = getattr(layer, "num_key_heads", getattr(layer, "num_heads", 0))
    n: int | None = getattr(layer, "num_householder", None)
    q = conv[:, : h * dk].reshape(1, t, h, dk)
    if n is None:
        k = conv[:, h * dk : 2 * h * dk].reshape(1, t, h, dk)
        v = conv[:, 2 * h * dk :].reshape(1, t, hv, dv)
    else:
        k = conv[:, h * dk : (n + 1) * h * dk].reshape(1, t, n, h, dk)
        v = conv[:, (n + 1) * h * dk :].reshape(1, t, n, hv, dv)
    h0 = [_np(a)[None] for a in _recurrent_parts(state)]
    o, hT, gate, act = REFERENCES[name](layer, x, q, k, v, *h0)
    hT = hT if isinstance(hT, tuple) else (hT,)
    o = o[0]
    o = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + layer.norm.eps)
    o = o * _np(layer.norm.weight) * act(gate.reshape(o.shape))
    out = o.reshape(t, hv * dv) @ _np(layer.out_proj.weight).T
    return out, np.concatenate([conv0, mixed], axis=0)[-hist:], tuple(a[0] for a in hT)


def _random_state(layer, key):
    """A random state; the preconditioner's (a sum of squares) in [0.1, 2]."""
    kc, kr = jr.split(key)
    s = layer.init_state()
    conv, recurrent = jr.normal(kc, s.conv.shape), 0.5 * jr.normal(kr, s.recurrent.shape)
    if isinstance(s, nn.PrecondLayerState):
        a = jr.uniform(jr.fold_in(key, 2), s.A.shape, minval=0.1, maxval=2.0)
        return nn.PrecondLayerState(conv=conv, recurrent=recurrent, A=a)
    return nn.RecurrentLayerState(conv=conv, recurrent=recurrent)


# ------------------------------------------------------------------------------------------------
# against float64, and decoding
# ------------------------------------------------------------------------------------------------
T, STEPS = 37, 3  # four full chunks and a partial one
EVERY = 16  # the preconditioned layers' checkpoints in that prefill: after 16 and 32 tokens


# Cost: one compiled program per layer (prefill of 34 tokens, then 3 steps).
@pytest.mark.parametrize("name", KINDS)
def test_matches_float64_reference_and_decodes(name):
    """`prefill` of all but 3 tokens from a random state, then 3 `step`s: the outputs, the
    conv state and the recurrent state (both, for a preconditioned layer) against the
    float64 layer over all 37 (<= 1e-5). The preconditioned layers' prefill also saves
    checkpoints every 16 tokens, each checked against the float64 layer over its prefix;
    and their random initial preconditioner state is seen (from zeros the float64 output
    is far off). The full sequence in one pass is checked, with its gradients, by
    `test_cp_invariance` (its one-device pass)."""
    layer = _layer(name)
    kx, ks = jr.split(jr.key(7))
    x = jr.normal(kx, (T, HIDDEN))
    state = _random_state(layer, ks)
    every = EVERY if name in PRECOND else None

    @eqx.filter_jit
    def run(layer, x, state):
        y, s, saved = layer.prefill(x[: T - STEPS], state, checkpoint_every=every)
        ys = [y]
        for t in range(T - STEPS, T):
            y_t, s = layer.step(x[t], s)
            ys.append(y_t[None])
        return jnp.concatenate(ys), s, saved

    y, new, saved = run(layer, x, state)
    out, conv, rec = layer_reference(name, layer, x, state)
    errs = {
        "prefill": rel_err(y[: T - STEPS], out[: T - STEPS]),
        "steps": rel_err(y[T - STEPS :], out[T - STEPS :]),
        "conv": rel_err(new.conv, conv),
        "recurrent": _recurrent_err(new, rec),
    }
    if every is not None:
        assert isinstance(saved, nn.PrecondLayerState) and isinstance(state, nn.PrecondLayerState)
        assert saved.A.shape == (2, *state.A.shape)
        for i, end in enumerate((EVERY, 2 * EVERY)):
            _, conv_i, rec_i = layer_reference(name, layer, x[:end], state)
            at_i = jax.tree.map(lambda a: a[i], saved)
            errs[f"checkpoint {end}"] = max(rel_err(at_i.conv, conv_i), _recurrent_err(at_i, rec_i))
        without_a = eqx.tree_at(lambda s: s.A, state, jnp.zeros_like(state.A))
        assert rel_err(layer_reference(name, layer, x, without_a)[0], out) > 1e-2
    assert max(errs.values()) <= 1e-5, errs
    assert type(new) is type(state) and y.dtype == x.dtype


# Cost: no compilation (shapes only).
@pytest.mark.parametrize("name", KINDS)
def test_shapes_and_errors(name):
    layer = _layer(name)
    s = layer.init_state()
    assert s.conv.shape == (layer.conv_kernel_size - 1, layer.conv_dim)
    assert s.recurrent.dtype == jnp.float32
    with pytest.raises(ValueError, match="`x` must have shape"):
        layer(jnp.zeros((4, HIDDEN + 1)))


# ------------------------------------------------------------------------------------------------
# context parallelism
# ------------------------------------------------------------------------------------------------
T_CP = 64


@ft.cache
def _cp_problem(name: str):
    layer = _layer(name)
    keys = jr.split(jr.key(38), 4)
    x = jr.normal(keys[0], (T_CP, HIDDEN))
    state = _random_state(layer, keys[1])
    return layer, x, state, jr.normal(keys[2], x.shape), _random_state(layer, keys[3])


def _cp_loss_and_grads(name: str, cp: int, layout: Any = dcp.Contiguous()):
    """Output, final state, and the gradients of a loss of both w.r.t. the parameters, the
    input and the state (in sequence order), at CP degree `cp` (1: one device); one
    compiled program."""
    layer, x, state, w_out, w_state = _cp_problem(name)
    params, static = eqx.partition(layer, eqx.is_array)

    def apply(params, x, state, context=None):
        return eqx.combine(params, static).prefill(x, state, cp=context)[:2]

    if cp > 1:
        x, w_out = (layout.to_layout(a[None], cp)[0] for a in (x, w_out))
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        apply = jax.shard_map(
            ft.partial(apply, context=dcp.ContextParallel("cp", layout=layout)),
            mesh=mesh,
            in_specs=(P(), P("cp"), P()),
            out_specs=(P("cp"), P()),
        )
        x, w_out = (jax.device_put(a, NamedSharding(mesh, P("cp"))) for a in (x, w_out))

    def loss(params, x, state):
        y, new = apply(params, x, state)
        total = jnp.sum(y * w_out) + jnp.sum(new.conv * w_state.conv)
        parts = zip(_recurrent_parts(new), _recurrent_parts(w_state), strict=True)
        return total + sum(jnp.sum(a * w) for a, w in parts), (y, new)

    grads, (y, new) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, state)
    if cp > 1:
        y = layout.from_layout(y[None], cp)[0]
        grads = (grads[0], layout.from_layout(grads[1][None], cp)[0], grads[2])
    return y, new, grads


@ft.cache
def _cp1(name: str):
    return _cp_loss_and_grads(name, 1)


def _max_leaf_err(a, b) -> float:
    return max(jax.tree.leaves(jax.tree.map(rel_err, a, b)))


# Each layer once in the default run, the two layouts alternating (the slow run: `_cp_cases`).
_CP_FAST = {
    "delta_net": (2, "contiguous"),
    "gla": (4, "zigzag"),
    "simple_gla": (2, "contiguous"),
    "gated_delta_product": (2, "zigzag"),
    "gdn2": (4, "contiguous"),
    "momentum": (2, "zigzag"),
    "precond_gdn": (2, "zigzag"),
    "precond_kda": (4, "contiguous"),
}
_LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}


# Cost: two compiled programs per case (the loss's gradient on one device, cached per layer,
# and sharded); every layer's one-device program is also the float64 check of its state.
def _cp_cases():
    """Each layer's default case, and in the slow run the other layout at the next number of
    ranks (2, 4, 8 in turn, where the convolution's halo fits): every layer meets both
    layouts and two numbers of ranks, and every layout and number of ranks meets several
    layers. (The whole product, 45 cases, cost three times these 16.)"""

    def fits(cp, layout):  # the convolution's halo
        return T_CP // cp // (2 if layout == "zigzag" else 1) >= 3

    cases = []
    for name in KINDS:
        cp, layout = _CP_FAST[name]
        cases.append(pytest.param(name, cp, layout, id=f"{name}-{layout}-{cp}"))
        other = "zigzag" if layout == "contiguous" else "contiguous"
        ranks = (2, 4, 8)
        for step in (1, 2):
            slow_cp = ranks[(ranks.index(cp) + step) % 3]
            if fits(slow_cp, other):
                break
        cases.append(
            pytest.param(
                name, slow_cp, other, id=f"{name}-{other}-{slow_cp}", marks=pytest.mark.slow
            )
        )
    return cases


@pytest.mark.parametrize("name, cp, layout", _cp_cases())
def test_cp_invariance(name, cp, layout):
    """Outputs, final state and every gradient (parameters, input, state) under context
    parallelism equal one device's (<= 1e-5), the one-device pass itself matching the
    float64 layer."""
    layer, x, state, *_ = _cp_problem(name)
    y1, new1, grads1 = _cp1(name)
    out, _, rec = layer_reference(name, layer, x, state)
    assert rel_err(y1, out) <= 1e-5 and _recurrent_err(new1, rec) <= 1e-5
    y, new, grads = _cp_loss_and_grads(name, cp, _LAYOUTS[layout])
    errs = {
        "output": rel_err(y, y1),
        "state": _max_leaf_err(new, new1),
        "grads": _max_leaf_err(grads, grads1),
    }
    assert max(errs.values()) <= 1e-5, errs


# ------------------------------------------------------------------------------------------------
# packed documents
# ------------------------------------------------------------------------------------------------
CU_PACKED = [0, 9, 9, 30, T_CP]  # an empty document; documents across ranks and pieces
_PACKED_FAST = ("momentum",)


# Cost: two compiled programs per layer (one device, cp = 2 zigzag).
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in _PACKED_FAST else pytest.mark.slow) for n in KINDS]
)
def test_packed_documents(name):
    """`cu_seqlens`: each document as its own call from zeros (the float64 layer per
    document: the convolution reads nothing across a document's start, the recurrence
    resets), on one device and on zigzag shards over 2 ranks."""
    layer, x, state, *_ = _cp_problem(name)
    zero = jax.tree.map(jnp.zeros_like, state)
    expected = np.concatenate(
        [
            layer_reference(name, layer, x[s:e], zero)[0]
            for s, e in zip(CU_PACKED[:-1], CU_PACKED[1:])
            if e > s
        ]
    )
    one = eqx.filter_jit(lambda m, x: m(x, cu_seqlens=CU_PACKED))(layer, x)
    assert rel_err(one, expected) <= 1e-5
    layout, cp = dcp.Zigzag(), 2
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    sharded = jax.shard_map(
        lambda m, x: m(x, cp=dcp.ContextParallel("cp", layout=layout), cu_seqlens=CU_PACKED),
        mesh=mesh,
        in_specs=(P(), P("cp")),
        out_specs=P("cp"),
    )
    x_cp = jax.device_put(layout.to_layout(x[None], cp)[0], NamedSharding(mesh, P("cp")))
    y = layout.from_layout(eqx.filter_jit(sharded)(layer, x_cp)[None], cp)[0]
    assert rel_err(y, one) <= 1e-5


# Cost: no compilation.
def test_packed_documents_refuse_a_state(without_runtime_typecheck):
    layer = _layer("gla")
    with pytest.raises(ValueError, match="pass `state=None`"):
        layer(jnp.zeros((8, HIDDEN)), layer.init_state(), cu_seqlens=[0, 4, 8])


# Cost: one compiled program (the half sequence on one device).
@pytest.mark.slow
@pytest.mark.parametrize("name", KINDS)
def test_cp_problem_depends_on_the_carried_state(name):
    """A wrong hand-off would be seen: the second half from zero states is far off."""
    y1, _, _ = _cp1(name)
    layer, x, *_ = _cp_problem(name)
    tail = eqx.filter_jit(lambda m, x: m(x))(layer, x[T_CP // 2 :])
    assert rel_err(tail, y1[T_CP // 2 :]) > 1e-2


# ------------------------------------------------------------------------------------------------
# HybridLM with any mixers
# ------------------------------------------------------------------------------------------------
# Cost: no compilation (`filter_eval_shape` and construction only).
def test_hybrid_mixers_by_name_and_factory():
    """`mixers` names a kind per block or builds one from a key; without it the default
    pattern (3 Gated DeltaNet : 1 attention) is unchanged."""
    key = jr.key(0)
    spelled: list[Any] = ["gated_delta_net"] * 3 + ["attention"]
    default = nn.HybridLM(32, 16, 4, key=key)
    assert bool(eqx.tree_equal(default, nn.HybridLM(32, 16, 4, mixers=spelled, key=key)))
    kinds: list[Any] = [
        "kimi_delta_attention",
        "gated_linear_attention",
        "simple_gated_linear_attention",
        "gated_delta_product",
        "gated_delta_net_2",
        "momentum_delta_net",
        "attention",
        lambda k: nn.GatedLinearAttention(16, 4, 4, 4, gate_low_rank_dim=4, key=k),
    ]
    model = eqx.filter_eval_shape(
        nn.HybridLM, 32, 16, len(kinds), mixers=kinds, key=key, chunk_size=CHUNK
    )
    assert [type(b.mixer) for b in model.blocks] == [
        nn.KimiDeltaAttention,
        nn.GatedLinearAttention,
        nn.SimpleGatedLinearAttention,
        nn.GatedDeltaProduct,
        nn.GatedDeltaNet2,
        nn.MomentumDeltaNet,
        nn.CausalSelfAttention,
        nn.GatedLinearAttention,
    ]
    assert model.blocks[-1].mixer.num_heads == 4


# Cost: no compilation.
def test_hybrid_mixers_errors(without_runtime_typecheck):
    """A wrong number of mixers or an unknown name: a `ValueError` saying what to pass."""
    key = jr.key(0)
    with pytest.raises(ValueError, match="one token mixer per block"):
        nn.HybridLM(32, 16, 3, mixers=["attention", "attention"], key=key)
    with pytest.raises(ValueError, match="Unknown token mixer 'mamba'"):
        nn.HybridLM(32, 16, 1, mixers=["mamba"], key=key)  # pyright: ignore[reportArgumentType]


# Cost: no compilation beyond the parameters' random draws (about 1 s).
def test_hybrid_builds_delta_net_by_name():
    model = nn.HybridLM(32, 16, 2, mixers=["delta_net", "attention"], key=jr.key(0))
    mixer = model.blocks[0].mixer
    assert isinstance(mixer, nn.DeltaNet) and mixer.chunk_size == 64


# Cost: no compilation (`filter_eval_shape` and construction only).
def test_hybrid_builds_precond_layers_by_name():
    """`"precond_gated_delta_net"` with the Gated DeltaNet sizes (a preconditioner per key
    head), `"precond_kimi_delta_attention"` with Kimi Delta Attention's."""
    mixers: list[Any] = ["precond_gated_delta_net", "precond_kimi_delta_attention"]
    model = eqx.filter_eval_shape(
        nn.HybridLM, 32, 16, 2, mixers=mixers, num_key_heads=2, num_value_heads=4, key=jr.key(0)
    )
    gdn, kda = (b.mixer for b in model.blocks)
    assert isinstance(gdn, nn.PrecondGatedDeltaNet) and isinstance(
        kda, nn.PrecondKimiDeltaAttention
    )
    assert gdn.log_atk_scale.shape == (2,) and gdn.A_log.shape == (4,)
    assert kda.log_atk_scale.shape == (4,) and kda.chunk_size == 64
    assert gdn.init_state().A.shape == (2, 16) and kda.init_state().A.shape == (4, 16)


# Cost: no compilation (the errors come before any parameter is drawn, or at trace time).
def test_precond_bad_arguments(without_runtime_typecheck):
    """Each out-of-range argument of the preconditioned layers: a `ValueError` naming it."""
    gdn = ft.partial(eqx.filter_eval_shape, nn.PrecondGatedDeltaNet, HIDDEN, 2, 4, 8, 4)
    kda = ft.partial(eqx.filter_eval_shape, nn.PrecondKimiDeltaAttention, HIDDEN, 2, 8)
    with pytest.raises(ValueError, match=r"`num_value_heads` \(3\) must be a multiple"):
        eqx.filter_eval_shape(nn.PrecondGatedDeltaNet, HIDDEN, 2, 3, 8, 4, key=jr.key(0))
    for make in (gdn, kda):
        with pytest.raises(ValueError, match="`squash_x` must be a finite float >= 1.0"):
            make(squash_x=0.5, key=jr.key(0))
        with pytest.raises(ValueError, match="`squash_eps` must be a finite float > 0.0"):
            make(squash_eps=0.0, key=jr.key(0))
        with pytest.raises(ValueError, match="`log_atk_scale_init` must be a finite float"):
            make(log_atk_scale_init=float("nan"), key=jr.key(0))


@ft.cache
def _hybrid():
    """Kimi Linear's 3 KDA : 1 attention pattern with a GLA block in place of one KDA, and
    its logits on one device."""
    mixers: list[Any] = ["kimi_delta_attention", "gated_linear_attention"]
    mixers += ["kimi_delta_attention", "attention"]
    model = nn.HybridLM(32, 16, 4, mixers=mixers, chunk_size=CHUNK, key=jr.key(3))
    tokens = jr.randint(jr.key(4), (32,), 0, 32)
    return model, tokens, eqx.filter_jit(lambda m, t: m(t))(model, tokens)


# Cost: one compiled program (the model's forward on one device).
def test_hybrid_kimi_linear_pattern_runs():
    _, _, logits = _hybrid()
    assert logits.shape == (32, 32) and bool(jnp.all(jnp.isfinite(logits)))


# Cost: two compiled programs (one device, shared with the test above; cp = 2 zigzag).
@pytest.mark.slow
def test_hybrid_kimi_linear_pattern_context_parallel():
    """The mixed pattern on zigzag shards over 2 ranks: the same logits as one device."""
    model, tokens, logits = _hybrid()
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    sharded = jax.shard_map(
        lambda m, t: m(t, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag())),
        mesh=mesh,
        in_specs=(P(), P("cp")),
        out_specs=P("cp"),
    )
    zig = jax.device_put(dcp.to_zigzag(tokens[None], 2)[0], NamedSharding(mesh, P("cp")))
    logits_cp = dcp.from_zigzag(eqx.filter_jit(sharded)(model, zig)[None], 2)[0]
    assert rel_err(logits_cp, logits) <= 1e-5


# ------------------------------------------------------------------------------------------------
# RWKV-7
# ------------------------------------------------------------------------------------------------
RWKV_SIZES = (HIDDEN, 2, 8, 4)  # hidden, H, K, V: K != V, H K = hidden
RWKV_NORM_EPS = 1e-5


def _rwkv7_draw(path, leaf, rng):
    """A value for each parameter, drawn with NumPy (no program to compile), around FLA's
    init but off it: FLA zeros the output projection and the LoRAs' first factors, which
    would hide most of the layer. The decays' LoRA bias spreads the per-token decays over
    [0.6, 0.998], so state crosses chunks and ranks."""
    name, shape = jax.tree_util.keystr(path), leaf.shape
    noise = rng.standard_normal(shape)
    if name.startswith(".x_"):
        value = rng.uniform(0, 1, shape)
    elif name == ".w_lora.up.bias":
        value = rng.uniform(-6, 1, shape)
    elif name in (".k_k", ".k_a", ".g_norm.weight"):
        value = {".k_k": 0.7, ".k_a": 1.0, ".g_norm.weight": 1.0}[name] + 0.2 * noise
    elif name.endswith("bias") or name == ".r_k":
        value = 0.5 * noise
    else:  # a linear layer's (out, in) weight
        value = noise / np.sqrt(shape[-1])
    return jnp.asarray(value, leaf.dtype)


@ft.cache
def _rwkv7(layer_idx: int):
    """Layer `layer_idx` of two (0: the first, which makes `v_first`), LoRA ranks 8 and 4,
    with `_rwkv7_draw`'s parameters."""
    shapes = eqx.filter_eval_shape(
        nn.RWKV7Attention,
        *RWKV_SIZES,
        layer_idx=layer_idx,
        num_layers=2,
        decay_low_rank_dim=8,
        a_low_rank_dim=8,
        v_low_rank_dim=4,
        gate_low_rank_dim=8,
        norm_eps=RWKV_NORM_EPS,
        chunk_size=CHUNK,
        key=jr.key(0),
    )
    rng = np.random.default_rng(40 + layer_idx)
    return jax.tree_util.tree_map_with_path(lambda p, s: _rwkv7_draw(p, s, rng), shapes)


def _rwkv7_state(seed: int):
    rng = np.random.default_rng(seed)
    _, h, dk, dv = RWKV_SIZES
    return nn.RWKV7AttentionState(
        shift=jnp.asarray(rng.standard_normal(HIDDEN), jnp.float32),
        recurrent=jnp.asarray(0.5 * rng.standard_normal((h, dk, dv)), jnp.float32),
    )


def _rwkv7_lora(lora, x):
    h = _lin(lora.down, x)
    h = {"tanh": np.tanh, "sigmoid": _sigmoid, None: lambda z: z}[lora.activation](h)
    return _lin(lora.up, h)


def rwkv7_reference(layer, x, state=None, v_first=None):
    """The whole RWKV-7 layer in float64 NumPy, written from FLA's `RWKV7Attention.forward`
    and its naive generalized delta rule (`dplr_recurrence`: the read `a^T S` of the state
    before the token's decay, `S <- S e^w + b (a^T S) + k v^T`, `o = S^T r`).

    **Returns:** `(out (T, hidden), the values before the mix (T, H, V), the last token,
    the recurrent state)`.
    """
    _, h, dk, dv = RWKV_SIZES
    x, t = _np(x), x.shape[0]
    shift = np.zeros(HIDDEN) if state is None else _np(state.shift)
    s = np.zeros((h, dk, dv)) if state is None else _np(state.recurrent).copy()
    prev = np.concatenate([shift[None], x[:-1]])

    def mix(mu):  # torch.addcmul(x, x_prev - x, mu)
        return x + (prev - x) * _np(mu)

    r = _lin(layer.r_proj, mix(layer.x_r)).reshape(t, h, dk)
    w = -np.exp(-0.5) * _sigmoid(_rwkv7_lora(layer.w_lora, mix(layer.x_w))).reshape(t, h, dk)
    k = _lin(layer.k_proj, mix(layer.x_k))
    v = _lin(layer.v_proj, mix(layer.x_v))
    values = v.reshape(t, h, dv)
    if layer.v_lora is not None:  # torch.lerp(v, v_first, sigmoid(v_lora(xv)))
        weight = _sigmoid(_rwkv7_lora(layer.v_lora, mix(layer.x_v)))
        v = v + weight * (_np(v_first).reshape(t, h * dv) - v)
    a = _sigmoid(_rwkv7_lora(layer.a_lora, mix(layer.x_a)))
    g = _rwkv7_lora(layer.g_lora, mix(layer.x_g))
    kk = (k * _np(layer.k_k)).reshape(t, h, dk)
    kk = kk / np.maximum(np.linalg.norm(kk, axis=-1, keepdims=True), 1e-12)  # F.normalize
    k = (k + k * (a - 1) * _np(layer.k_a)).reshape(t, h, dk)  # k.addcmul(k * (a - 1), k_a)
    v, a = v.reshape(t, h, dv), a.reshape(t, h, dk)
    alpha, beta = -kk, kk * a
    o = np.zeros((t, h, dv))
    for i in range(t):
        for j in range(h):
            read = alpha[i, j] @ s[j]  # a^T S, before the decay
            s[j] = np.exp(w[i, j])[:, None] * s[j] + np.outer(beta[i, j], read)
            s[j] = s[j] + np.outer(k[i, j], v[i, j])
            o[i, j] = s[j].T @ r[i, j]
    mean = o.mean(-1, keepdims=True)  # GroupNorm, one group per head
    var = ((o - mean) ** 2).mean(-1, keepdims=True)
    o = (o - mean) / np.sqrt(var + dk * RWKV_NORM_EPS)
    o = o.reshape(t, h * dv) * _np(layer.g_norm.weight) + _np(layer.g_norm.bias)
    bonus = np.sum(r * k * _np(layer.r_k)[None], axis=-1, keepdims=True) * v
    out = _lin(layer.o_proj, (o + bonus.reshape(t, h * dv)) * g)
    return out, values, x[-1], s


def _rwkv7_inputs(seed: int):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((T, HIDDEN)), jnp.float32)


@eqx.filter_jit
def _rwkv7_prefill_and_decode(layer, x, state, v_first):
    """`prefill` of all but `STEPS` tokens, then a `step` for each of them (a `lax.scan`),
    with the layer's `values` over the whole sequence and token by token."""
    n = T - STEPS

    def later(v):  # the first layer makes `v_first` and takes none
        return None if layer.is_first else v

    y, state_n, _ = layer.prefill(x[:n], state, v_first=later(v_first[:n]))

    def step(s, token):
        x_t, v_t = token
        value = layer.values(x_t[None], s)[0]
        y_t, s = layer.step(x_t, s, v_first=later(v_t))
        return s, (y_t, value)

    final, (ys, values) = jax.lax.scan(step, state_n, (x[n:], v_first[n:]))
    return jnp.concatenate([y, ys]), final, layer.values(x, state), values


# Cost: one compiled program per layer (values, prefill of 34 tokens, 3 steps in a scan),
# about 2 s each. The later layer in the default run: its path is the first's plus the mix
# with `v_first`; the first layer's is also traced by `test_hybrid_rwkv7_traces`.
@pytest.mark.parametrize(
    "layer_idx", [pytest.param(0, marks=pytest.mark.slow), 1], ids=["first", "later"]
)
def test_rwkv7_matches_float64_reference_and_decodes(layer_idx):
    """The first layer, and a later one with `v_first` the first's float64 values:
    `prefill` of all but 3 tokens from a random state, then 3 `step`s, against the float64
    layer over all 37 (<= 1e-5): outputs, both parts of the state, and `values` over the
    sequence and token by token."""
    layer = _rwkv7(layer_idx)
    x, state = _rwkv7_inputs(1 + layer_idx), _rwkv7_state(3 + layer_idx)
    _, v_first, _, _ = rwkv7_reference(_rwkv7(0), _rwkv7_inputs(1), _rwkv7_state(3))
    v_first = jnp.asarray(v_first, jnp.float32)
    y, new, values, stepped = _rwkv7_prefill_and_decode(layer, x, state, v_first)
    out, expected_values, shift, rec = rwkv7_reference(layer, x, state, v_first)
    n = T - STEPS
    errs = {
        "prefill": rel_err(y[:n], out[:n]),
        "steps": rel_err(y[n:], out[n:]),
        "shift": rel_err(new.shift, shift),
        "recurrent": rel_err(new.recurrent, rec),
        "values": rel_err(values, expected_values),
        "values, one token": rel_err(stepped, expected_values[n:]),
    }
    assert max(errs.values()) <= 1e-5, errs
    assert isinstance(new, nn.RWKV7AttentionState) and y.dtype == x.dtype


# Cost: no compilation (shapes only).
def test_rwkv7_shapes_and_errors(without_runtime_typecheck):
    first, later = _rwkv7(0), _rwkv7(1)
    assert first.is_first and first.v_lora is None and not later.is_first
    s = later.init_state()
    assert s.shift.shape == (HIDDEN,) and s.recurrent.shape == (2, 8, 4)
    assert s.recurrent.dtype == jnp.float32
    x = jnp.zeros((8, HIDDEN))
    with pytest.raises(ValueError, match="not the first layer: pass `v_first=`"):
        later(x)
    with pytest.raises(ValueError, match="is the first layer"):
        first(x, v_first=jnp.zeros((8, 2, 4)))
    with pytest.raises(ValueError, match=r"`v_first` must be .* \(8, 2, 4\); got \(7, 2, 4\)"):
        later(x, v_first=jnp.zeros((7, 2, 4)))
    with pytest.raises(ValueError, match="`x` must have shape"):
        first(jnp.zeros((4, HIDDEN + 1)))
    with pytest.raises(ValueError, match="RWKV7Attention: .* pass `state=None`"):
        first(x, first.init_state(), cu_seqlens=[0, 4, 8])
    with pytest.raises(ValueError, match=r"`layer_idx` \(2\) must be in \[0, num_layers\)"):
        nn.RWKV7Attention(*RWKV_SIZES, layer_idx=2, num_layers=2, key=jr.key(0))
    with pytest.raises(ValueError, match="first RWKV-7 mixer in `mixers`"):
        eqx.filter_eval_shape(
            nn.HybridLM,
            32,
            16,
            1,
            mixers=[lambda k: nn.RWKV7Attention(16, 2, 8, 8, layer_idx=1, num_layers=2, key=k)],
            key=jr.key(0),
        )


@ft.cache
def _rwkv7_cp_problem():
    """The later layer (the one that takes `v_first`), a sequence of 64 tokens, a random
    state and `v_first`, and the loss weights."""
    rng = np.random.default_rng(48)

    def normal(*shape, scale=1.0):
        return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32)

    _, h, _, dv = RWKV_SIZES
    x, v_first = normal(T_CP, HIDDEN), normal(T_CP, h, dv)
    weights = (normal(T_CP, HIDDEN), _rwkv7_state(49))
    return _rwkv7(1), x, _rwkv7_state(50), v_first, weights


def _rwkv7_cp_loss_and_grads(cp: int, layout: Any = dcp.Contiguous()):
    """Output, final state, and the gradients of a loss of both w.r.t. the parameters, the
    input, the state and `v_first` (in sequence order), at CP degree `cp` (1: one device);
    one compiled program."""
    layer, x, state, v_first, (w_out, w_state) = _rwkv7_cp_problem()
    params, static = eqx.partition(layer, eqx.is_array)

    def apply(params, x, state, v_first, context=None):
        layer = eqx.combine(params, static)
        return layer.prefill(x, state, v_first=v_first, cp=context)[:2]

    if cp > 1:
        x, v_first, w_out = (layout.to_layout(a[None], cp)[0] for a in (x, v_first, w_out))
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        apply = jax.shard_map(
            ft.partial(apply, context=dcp.ContextParallel("cp", layout=layout)),
            mesh=mesh,
            in_specs=(P(), P("cp"), P(), P("cp")),
            out_specs=(P("cp"), P()),
        )
        x, v_first, w_out = (
            jax.device_put(a, NamedSharding(mesh, P("cp"))) for a in (x, v_first, w_out)
        )

    def loss(params, x, state, v_first):
        y, new = apply(params, x, state, v_first)
        total = jnp.sum(y * w_out) + jnp.sum(new.shift * w_state.shift)
        return total + jnp.sum(new.recurrent * w_state.recurrent), (y, new)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    grads, (y, new) = grad(params, x, state, v_first)
    if cp > 1:
        y = layout.from_layout(y[None], cp)[0]
        d_x, d_v = (layout.from_layout(d[None], cp)[0] for d in (grads[1], grads[3]))
        grads = (grads[0], d_x, grads[2], d_v)
    return y, new, grads


@ft.cache
def _rwkv7_cp1():
    return _rwkv7_cp_loss_and_grads(1)


# Cost: two compiled programs per case (the loss's gradient on one device, cached, and
# sharded): about 10 s for zigzag over 2 ranks, the default case (3 s and 7 s), 4 to 8 s for
# the others; the one-device program is also the float64 check of the whole sequence in
# one pass and of its state.
@pytest.mark.parametrize(
    "cp, layout",
    [
        pytest.param(
            cp,
            layout,
            id=f"{layout}-{cp}",
            marks=() if (cp, layout) == (2, "zigzag") else (pytest.mark.slow,),
        )
        for cp in (2, 4, 8)
        for layout in ("contiguous", "zigzag")
    ],
)
def test_rwkv7_cp_invariance(cp, layout):
    """Outputs, final state and every gradient (parameters, input, state, `v_first`) under
    context parallelism equal one device's (<= 1e-5), the one-device pass matching the
    float64 layer."""
    layer, x, state, v_first, _ = _rwkv7_cp_problem()
    y1, new1, grads1 = _rwkv7_cp1()
    out, _, shift, rec = rwkv7_reference(layer, x, state, v_first)
    assert rel_err(y1, out) <= 1e-5 and rel_err(new1.recurrent, rec) <= 1e-5
    assert rel_err(new1.shift, shift) <= 1e-5
    y, new, grads = _rwkv7_cp_loss_and_grads(cp, _LAYOUTS[layout])
    errs = {
        "output": rel_err(y, y1),
        "state": _max_leaf_err(new, new1),
        "grads": _max_leaf_err(grads, grads1),
    }
    assert max(errs.values()) <= 1e-5, errs


# Cost: one compiled program (the second half on one device), about 1 s.
@pytest.mark.slow
def test_rwkv7_cp_problem_depends_on_the_carried_state():
    """A wrong hand-off would be seen: the second half from a zero state is far off."""
    y1, _, _ = _rwkv7_cp1()
    layer, x, _, v_first, _ = _rwkv7_cp_problem()
    half = T_CP // 2
    tail = eqx.filter_jit(lambda m, x, v: m(x, v_first=v))(layer, x[half:], v_first[half:])
    assert rel_err(tail, y1[half:]) > 1e-2


# Cost: one compiled program (one device, 2 s); the zigzag case two more (4 s). Both slow: the
# token shift's documents are `previous_tokens`'s (tests/test_shift.py), the recurrence's
# the engine's.
@pytest.mark.slow
@pytest.mark.parametrize("cp", [1, 2])
def test_rwkv7_packed_documents(cp):
    """`cu_seqlens`: each document as its own call from zeros (the float64 layer per
    document: the token shift reads zeros at a document's start, the recurrence resets),
    on one device and on zigzag shards over 2 ranks."""
    layer, x, _, v_first, _ = _rwkv7_cp_problem()
    expected = np.concatenate(
        [
            rwkv7_reference(layer, x[s:e], None, v_first[s:e])[0]
            for s, e in zip(CU_PACKED[:-1], CU_PACKED[1:])
            if e > s
        ]
    )
    call = eqx.filter_jit(lambda m, x, v: m(x, v_first=v, cu_seqlens=CU_PACKED))
    if cp == 1:
        assert rel_err(call(layer, x, v_first), expected) <= 1e-5
        return
    layout = dcp.Zigzag()
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    sharded = jax.shard_map(
        lambda m, x, v: m(
            x, v_first=v, cp=dcp.ContextParallel("cp", layout=layout), cu_seqlens=CU_PACKED
        ),
        mesh=mesh,
        in_specs=(P(), P("cp"), P("cp")),
        out_specs=P("cp"),
    )
    x_cp, v_cp = (
        jax.device_put(layout.to_layout(a[None], cp)[0], NamedSharding(mesh, P("cp")))
        for a in (x, v_first)
    )
    y = layout.from_layout(eqx.filter_jit(sharded)(layer, x_cp, v_cp)[None], cp)[0]
    assert rel_err(y, expected) <= 1e-5


def _rwkv7_hybrid(key):
    """`HybridLM` with two RWKV-7 blocks around an attention block."""
    mixers: list[Any] = ["rwkv7", "attention", "rwkv7"]
    return nn.HybridLM(32, 16, 3, mixers=mixers, chunk_size=CHUNK, key=key)


# Cost: no compilation (construction, the forward and the gradient traced only), about 1 s.
def test_hybrid_rwkv7_traces():
    """`"rwkv7"` twice: the first block is the first RWKV-7 layer, the later one is not,
    and the forward and its gradient trace (the later layer would raise without the first
    one's values as its `v_first`)."""
    model = eqx.filter_eval_shape(_rwkv7_hybrid, jr.key(5))
    mixers = [b.mixer for b in model.blocks]
    kinds = [nn.RWKV7Attention, nn.CausalSelfAttention, nn.RWKV7Attention]
    assert [type(m) for m in mixers] == kinds
    assert mixers[0].is_first and not mixers[2].is_first
    tokens = jax.ShapeDtypeStruct((24,), jnp.int32)
    logits, grads = eqx.filter_eval_shape(
        lambda m, t: (m(t), eqx.filter_grad(lambda m: jnp.sum(m(t)))(m)), model, tokens
    )
    assert logits.shape == (24, 32) and grads.blocks[2].mixer.v_lora is not None


# Cost: one compiled program (the model's logits, the same blocks by hand, and the
# gradient), 8 to 10 s with the model's construction.
@pytest.mark.slow
def test_hybrid_rwkv7_threads_v_first():
    """`HybridLM` with two RWKV-7 blocks around attention: the logits equal the blocks
    applied by hand with the first block's values as the later one's `v_first` (<= 1e-6),
    and the gradient is finite and reaches both RWKV-7 layers."""
    model = _rwkv7_hybrid(jr.key(5))
    first, later = model.blocks[0].mixer, model.blocks[2].mixer
    assert isinstance(first, nn.RWKV7Attention) and isinstance(later, nn.RWKV7Attention)
    assert first.is_first and not later.is_first
    # FLA zeros the output projections; random ones let the check see the layers.
    rng = np.random.default_rng(6)
    model = eqx.tree_at(
        lambda m: [m.blocks[i].mixer.o_proj.weight for i in (0, 2)],
        model,
        [jnp.asarray(0.1 * rng.standard_normal((16, 64)), jnp.float32) for _ in range(2)],
    )
    tokens = jnp.asarray(rng.integers(0, 32, 24))

    def by_hand(model, tokens):
        x = jax.vmap(model.embed)(tokens)
        v_first = None
        for block in model.blocks:
            h = jax.vmap(block.mixer_norm)(x)
            if isinstance(block.mixer, nn.RWKV7Attention):
                if block.mixer.is_first:
                    v_first = block.mixer.values(h)
                    h = block.mixer(h)
                else:
                    h = block.mixer(h, v_first=v_first)
            else:
                h = block.mixer(h)
            x = x + h
            x = x + jax.vmap(lambda y: block.mlp(block.mlp_norm(y)))(x)
        return jax.vmap(lambda y: model.lm_head(model.norm(y)))(x)

    @eqx.filter_jit
    def run(model, tokens):
        def loss(model):
            logits = model(tokens)
            return jnp.sum(jnp.sin(logits)), logits

        grads, logits = eqx.filter_grad(loss, has_aux=True)(model)
        return logits, by_hand(model, tokens), grads

    logits, expected, grads = run(model, tokens)
    assert rel_err(logits, expected) <= 1e-6
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    for i in (0, 2):
        assert float(jnp.max(jnp.abs(grads.blocks[i].mixer.v_proj.weight))) > 0


# Cost: one compiled program (a prefill of 34 tokens with checkpoints every 16), about 2 s.
@pytest.mark.slow
def test_rwkv7_checkpoints():
    """`prefill(..., checkpoint_every=16)`: the states after 16 and 32 tokens equal the
    float64 layer's over those prefixes (<= 1e-5)."""
    layer, x, state = _rwkv7(1), _rwkv7_inputs(2), _rwkv7_state(4)
    v_first = jnp.asarray(np.random.default_rng(5).standard_normal((T, 2, 4)), jnp.float32)
    n = T - STEPS
    prefill = eqx.filter_jit(lambda m, x, s, v: m.prefill(x, s, v_first=v, checkpoint_every=16))
    _, _, saved = prefill(layer, x[:n], state, v_first[:n])
    assert saved is not None and saved.recurrent.shape == (2, 2, 8, 4)
    for i, end in enumerate((16, 32)):
        _, _, shift, rec = rwkv7_reference(layer, x[:end], state, v_first[:end])
        assert rel_err(saved.shift[i], shift) <= 1e-5
        assert rel_err(saved.recurrent[i], rec) <= 1e-5

"""The preconditioned delta rules beyond the registry's properties (tests/registry.py holds
their main stage): the preconditioner's initial and final states, q/k L2 normalisation, a
centre per key head, GVA, gradients w.r.t. every input, context parallelism over every
exchange and both layouts with packed documents, and the argument checks. Everything is
checked against the float64 token loop `precond_reference` (tests/helpers.py).
"""

import functools as ft
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp.interop import fla

from .helpers import (
    directional_check,
    make_precond_gdn_inputs,
    make_precond_kda_inputs,
    pairwise,
    precond_reference,
    rel_err,
)
from .registry import exchange_id, EXCHANGES


pytestmark = pytest.mark.usefixtures("fast_compile")

# Two key heads, each read by two value heads (GVA), K != V.
SHAPE = dict(b=2, t=37, h=2, hv=4, dk=8, dv=6)
OPTIONS = dict(x=1.7, eps=1e-5)
KINDS = ["gdn", "kda"]


def _make(kind, seed, **shape):
    make = make_precond_gdn_inputs if kind == "gdn" else make_precond_kda_inputs
    return make(seed, **shape)


def _chunk(kind):
    return dcp.chunk_precond_gated_delta_rule if kind == "gdn" else dcp.chunk_precond_kda


def _recurrent(kind):
    return dcp.recurrent_precond_gated_delta_rule if kind == "gdn" else dcp.recurrent_precond_kda


def _loop_order(kind, args):
    """The public arguments in `precond_reference`'s order `(q, k, v, g_atk, g, beta_atk,
    beta)` (KDA's public order has `g` before `g_atk`)."""
    if kind == "gdn":
        return tuple(args)
    q, k, v, g, g_atk, beta_atk, beta = args
    return q, k, v, g_atk, g, beta_atk, beta


def _a_states(seed, n, h, dk):
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.abs(rng.normal(size=(n, h, dk))) * 0.3, jnp.float32)


def _weights(x, phase):
    return jnp.cos(jnp.arange(x.size, dtype=x.dtype) + phase).reshape(x.shape)


def _loss(o, s, a):
    return jnp.sum(o * _weights(o, 0)) + jnp.sum(s * _weights(s, 1)) + jnp.sum(a * _weights(a, 2))


def _loss64(o, s, a):
    w = [np.cos(np.arange(x.size) + p).reshape(x.shape) for x, p in ((o, 0), (s, 1), (a, 2))]
    return float(np.sum(o * w[0]) + np.sum(s * w[1]) + np.sum(a * w[2]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_states_and_gradients_match_loop(kind, form):
    # q/k l2norm, a centre per key head, both initial states, another range and eps: the
    # outputs, both final states and the gradients w.r.t. every input (the preconditioner's
    # gates, its initial state and its centre included) against the float64 loop.
    args, h0 = _make(kind, 0, **SHAPE)
    a0 = _a_states(1, SHAPE["b"], SHAPE["h"], SHAPE["dk"])
    center = jnp.asarray([-0.5, 0.4], jnp.float32)
    fn = _chunk(kind) if form == "chunk" else _recurrent(kind)
    size = {"chunk_size": 8} if form == "chunk" else {}

    @jax.jit
    def value_and_grad(arrays):
        def loss(arrays):
            *xs, h0, a0, c = arrays
            o, s, a = fn(
                *xs,
                initial_state=h0,
                initial_A_state=a0,
                log_atk_scale=c,
                use_qk_l2norm=True,
                **OPTIONS,
                **size,
            )
            return _loss(o, s, a), (o, s, a)

        return jax.value_and_grad(loss, has_aux=True)(arrays)

    arrays = [*args, h0, a0, center]
    (_, (o, s, a)), grads = value_and_grad(arrays)

    def reference(arrays):
        *xs, h0, a0, c = arrays
        return precond_reference(
            *_loop_order(kind, xs),
            initial_state=h0,
            initial_A_state=a0,
            log_atk_scale=c,
            l2norm=True,
            **OPTIONS,
        )

    eo, es, ea = reference(arrays)
    assert a.shape == (SHAPE["b"], SHAPE["h"], SHAPE["dk"])  # one per key head
    assert rel_err(o, eo) <= 1e-5
    assert rel_err(s, es) <= 1e-5
    assert rel_err(a, ea) <= 1e-5
    names = [
        *(("q", "k", "v", "g_atk", "g") if kind == "gdn" else ("q", "k", "v", "g", "g_atk")),
        "beta_atk",
        "beta",
        "initial_state",
        "initial_A_state",
        "log_atk_scale",
    ]
    errors = directional_check(grads, lambda a: _loss64(*reference(a)), arrays)
    for name, err in zip(names, errors, strict=True):
        assert err <= 1e-5, (name, err)  # measured <= 7e-7


@pytest.mark.parametrize("kind", KINDS)
def test_packed_documents_with_both_states(kind):
    # Packed documents on one device: per-document initial and final states of both stages.
    cu = [0, 5, 21, 22, 40]
    args, _ = _make(kind, 3, b=1, t=40, h=2, hv=4, dk=8, dv=6)
    rng = np.random.default_rng(4)
    h0 = jnp.asarray(rng.normal(size=(4, 4, 8, 6)), jnp.float32)
    a0 = _a_states(5, 4, 2, 8)
    o, s, a = _chunk(kind)(*args, initial_state=h0, initial_A_state=a0, cu_seqlens=cu, chunk_size=4)
    eo, es, ea = precond_reference(
        *_loop_order(kind, args), initial_state=h0, initial_A_state=a0, cu_seqlens=cu
    )
    assert a.shape == (4, 2, 8)
    assert rel_err(o, eo) <= 1e-5
    assert rel_err(s, es) <= 1e-5
    assert rel_err(a, ea) <= 1e-5


# cp, layout and exchange: both kinds, both layouts, with and without packed documents in
# two cases of the default run (compiling two engine runs and their VJPs on up to 8 devices
# dominates; the registry's property tests run the main stage under every exchange and cp);
# every pair in the slow run.
LAYOUTS = [dcp.Contiguous(), dcp.Zigzag()]
CU = [None, [0, 7, 8, 25, 32]]
FAST_CP = {
    ("kda", 2, "Contiguous", "PPermute", 0),
    ("gdn", 4, "Zigzag", "Ring", 1),
}


def _cp_params():
    def fast(kind, cp, layout, exchange, docs):
        names = (type(layout).__name__, type(exchange).__name__)
        return (kind, cp, *names, docs) in FAST_CP

    return pairwise(
        [KINDS, [2, 4, 8], LAYOUTS, EXCHANGES, [0, 1]],
        ids=[str, lambda c: f"cp{c}", lambda x: type(x).__name__, exchange_id, str],
        fast=fast,
        slow_cover=[(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (2, 4), (3, 4)],
    )


@pytest.mark.parametrize("kind, cp, layout, exchange, docs", _cp_params())
def test_cp_matches_loop(kind, cp, layout, exchange, docs):
    # Both stages context-parallel under one ContextParallel (a mesh, global arrays in
    # sequence order): outputs, both final states and the gradients w.r.t. every input
    # against the float64 loop.
    cu = CU[docs]
    n = 1 if cu is None else len(cu) - 1
    args, _ = _make(kind, 7, b=1, t=32, h=2, hv=4, dk=8, dv=6)
    rng = np.random.default_rng(8)
    h0 = jnp.asarray(rng.normal(size=(n, 4, 8, 6)), jnp.float32)
    a0 = _a_states(9, n, 2, 8)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    parallel = dcp.ContextParallel("cp", mesh=mesh, layout=layout, exchange=exchange)

    @jax.jit
    def value_and_grad(arrays):
        def loss(arrays):
            *xs, h0, a0 = arrays
            o, s, a = _chunk(kind)(
                *xs,
                initial_state=h0,
                initial_A_state=a0,
                cu_seqlens=cu,
                chunk_size=4,
                cp=parallel,
                use_qk_l2norm=True,
            )
            return _loss(o, s, a), (o, s, a)

        return jax.value_and_grad(loss, has_aux=True)(arrays)

    arrays = [*args, h0, a0]
    (_, (o, s, a)), grads = value_and_grad(arrays)

    def reference(arrays):
        *xs, h0, a0 = arrays
        return precond_reference(
            *_loop_order(kind, xs), initial_state=h0, initial_A_state=a0, cu_seqlens=cu, l2norm=True
        )

    eo, es, ea = reference(arrays)
    assert rel_err(o, eo) <= 1e-5
    assert rel_err(s, es) <= 1e-5
    assert rel_err(a, ea) <= 1e-5
    errors = directional_check(grads, lambda a: _loss64(*reference(a)), arrays)
    assert max(errors) <= 1e-4, errors


@pytest.mark.slow  # 12 s: the eager path compiles each operation (136 programs)
def test_global_arrays_eager_and_placed_on_an_explicit_mesh():
    # Global arrays over a `jax.make_mesh` mesh (`Explicit` axes): an eager `jax.grad` of
    # unplaced arrays, and a jitted one of arrays the caller placed on that mesh, equal the
    # one-device run (the two stages' arrays meet on one mesh).
    args, _ = _make("gdn", 11, b=1, t=32, h=2, hv=4, dk=8, dv=6)
    mesh = jax.make_mesh((4,), ("cp",), devices=jax.devices()[:4])
    parallel = dcp.ContextParallel("cp", mesh=mesh)

    def loss(arrays, cp):
        o, s, a = dcp.chunk_precond_gated_delta_rule(*arrays, chunk_size=4, cp=cp)
        return _loss(o, s, a)

    expected = jax.grad(loss)(list(args), None)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "cp"))
    placed = [jax.device_put(x, sharding) for x in args]
    for grads in (
        jax.grad(loss)(list(args), parallel),
        jax.jit(jax.grad(loss), static_argnums=1)(placed, parallel),
    ):
        for got, want in zip(grads, expected):
            assert rel_err(got, want) <= 1e-5
    # Packed documents under `jit`: the outputs come back typed on the caller's mesh.
    cu_seqlens = jnp.array([0, 5, 20, 32], jnp.int32)
    fn = ft.partial(dcp.chunk_precond_gated_delta_rule, chunk_size=4, cu_seqlens=cu_seqlens)
    got = jax.jit(ft.partial(fn, cp=parallel))(*placed)
    for x, want in zip(got, fn(*args)):
        assert x.sharding.mesh == mesh
        assert rel_err(x, want) <= 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_unit_range_is_the_plain_rule(kind):
    # x = 1: the write key is the key, so the rule is Gated DeltaNet / KDA.
    args, h0 = _make(kind, 11, **SHAPE)
    q, k, v, g_atk, g, beta_atk, beta = _loop_order(kind, args)
    o, s, _ = _chunk(kind)(*args, initial_state=h0, x=1.0, chunk_size=8)
    plain = dcp.chunk_gated_delta_rule if kind == "gdn" else dcp.chunk_kda
    po, ps = plain(q, k, v, g, beta, initial_state=h0, chunk_size=8)
    assert rel_err(o, po) <= 1e-6
    assert rel_err(s, ps) <= 1e-6


def test_bad_arguments(without_runtime_typecheck):
    args, _ = _make("gdn", 0, b=1, t=8, h=2, hv=4, dk=8, dv=6)
    fn = dcp.chunk_precond_gated_delta_rule
    with pytest.raises(ValueError, match=r"`x` must be a finite float >= 1.0; got 0.5"):
        fn(*args, x=0.5)
    with pytest.raises(ValueError, match=r"`eps` must be a finite float > 0.0; got 0.0"):
        fn(*args, eps=0.0)
    with pytest.raises(TypeError, match=r"`x` must be a Python float"):
        fn(*args, x="big")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match=r"`log_atk_scale` .* shape \(H,\) = \(2,\).*got shape"):
        fn(*args, log_atk_scale=jnp.zeros(4))
    with pytest.raises(ValueError, match=r"`initial_A_state` must have shape \(B, H, K\)"):
        fn(*args, initial_A_state=jnp.zeros((1, 4, 8)))
    # With packed documents, one state per document, named as `initial_A_state`.
    packed = [a[:1] for a in args]
    with pytest.raises(ValueError, match=r"`initial_A_state` must have shape \(N, one per doc"):
        fn(*packed, cu_seqlens=jnp.asarray([0, 3, 8]), initial_A_state=jnp.zeros((3, 2, 8)))
    q, k, v, g_atk, g, beta_atk, beta = args
    with pytest.raises(ValueError, match=r"`g_atk` must have shape \(batch, seq, heads\)"):
        fn(q, k, v, g, g, beta_atk, beta)  # a gate per value head, not per key head
    with pytest.raises(ValueError, match=r"`g` must have rank 4"):
        dcp.chunk_precond_kda(q, k, v, g, g_atk, beta_atk, beta)


def test_traced_range_refused(without_runtime_typecheck):
    args, _ = _make("gdn", 0, b=1, t=8, h=1, hv=2, dk=8, dv=6)

    @jax.jit
    def fn(x):
        return dcp.chunk_precond_gated_delta_rule(*args, x=x)  # pyright: ignore[reportArgumentType]

    with pytest.raises(TypeError, match=r"`x` must be a Python float known when tracing"):
        fn(1.5)


# ---------------------------------------------------------------------------------------
# flash-linear-attention's call shapes (deltanet_cp.interop.fla)
# ---------------------------------------------------------------------------------------

FLA_POSITIONAL = {
    "chunk_precond_gated_delta_rule": "q k v g_atk g beta_atk beta scale initial_state "
    "initial_A_state output_final_state use_qk_l2norm_in_kernel",
    "fused_recurrent_precond_gated_delta_rule": "q k v g gk gv beta g_atk beta_atk scale "
    "initial_state initial_A_state output_final_state use_qk_l2norm_in_kernel",
    "chunk_precond_kda": "q k v g g_atk beta_atk beta scale initial_state initial_A_state "
    "output_final_state",
    "fused_recurrent_precond_kda": "q k v g g_atk beta_atk beta A_log dt_bias scale "
    "initial_state initial_A_state output_final_state use_qk_l2norm_in_kernel",
}


@pytest.mark.parametrize("name, expected", FLA_POSITIONAL.items(), ids=list(FLA_POSITIONAL))
def test_fla_argument_order(name, expected):
    parameters = inspect.signature(getattr(fla, name)).parameters.values()
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == expected.split()
    keywords = {p.name for p in parameters}
    assert {"cu_seqlens", "cp", "x", "eps", "log_atk_scale", "transpose_state_layout"} <= keywords


@pytest.mark.parametrize("kind", KINDS)
def test_fla_chunk_adapter(kind):
    # FLA's defaults: q/k L2-normalised, no final states unless asked for; the transposed
    # state layout on the way in and out; the loop with FLA's conventions (the
    # preconditioner's final state one per key head under GVA).
    args, h0 = _make(kind, 13, **SHAPE)
    a0 = _a_states(14, SHAPE["b"], SHAPE["h"], SHAPE["dk"])
    fn = fla.chunk_precond_gated_delta_rule if kind == "gdn" else fla.chunk_precond_kda
    o, s, a = fn(*args, None, h0, a0, chunk_size=8)  # pyright: ignore[reportCallIssue]
    assert s is None and a is None
    h0_vk = jnp.swapaxes(h0, -1, -2)
    o, s, a = fn(*args, None, h0_vk, a0, True, transpose_state_layout=True)  # pyright: ignore
    eo, es, ea = precond_reference(
        *_loop_order(kind, args), initial_state=h0, initial_A_state=a0, l2norm=True
    )
    assert s is not None and a is not None and a.shape == (2, 2, 8)
    assert rel_err(o, eo) <= 1e-5
    assert rel_err(jnp.swapaxes(s, -1, -2), es) <= 1e-5
    assert rel_err(a, ea) <= 1e-5


def test_fla_fused_recurrent_adapters():
    args, h0 = _make("kda", 15, b=1, t=12, h=2, hv=4, dk=8, dv=6)
    q, k, v, gk, g_atk, beta_atk, beta = args
    g = -jnp.abs(v[..., 0]) * 0.1  # a decay per value head besides the per-channel one
    # gk and g together: KDA with the decays multiplied.
    o, s, a = fla.fused_recurrent_precond_gated_delta_rule(
        q, k, v, g, gk, None, beta, g_atk, beta_atk, None, h0, None, True
    )
    eo, es, ea = precond_reference(
        q, k, v, g_atk, gk + g[..., None], beta_atk, beta, initial_state=h0, l2norm=True
    )
    assert rel_err(o, eo) <= 1e-5 and rel_err(s, es) <= 1e-5 and rel_err(a, ea) <= 1e-5
    # g alone: the preconditioned gated delta rule; no decay and beta ones by default.
    o, _, _ = fla.fused_recurrent_precond_gated_delta_rule(
        q, k, v, None, None, None, None, g_atk, beta_atk
    )
    ones = jnp.ones(v.shape[:3], v.dtype)
    eo, _, _ = precond_reference(q, k, v, g_atk, 0 * ones, beta_atk, ones, l2norm=True)
    assert rel_err(o, eo) <= 1e-5
    o, s, a = fla.fused_recurrent_precond_kda(*args, output_final_state=True)
    eo, es, ea = precond_reference(*_loop_order("kda", args), l2norm=True)
    assert rel_err(o, eo) <= 1e-5 and rel_err(s, es) <= 1e-5 and rel_err(a, ea) <= 1e-5


def test_fla_options(without_runtime_typecheck):
    args, _ = _make("kda", 0, b=1, t=8, h=1, hv=2, dk=8, dv=6)
    with pytest.raises(ValueError, match="use_gate_in_kernel"):
        fla.chunk_precond_kda(*args, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="cp_context"):
        fla.chunk_precond_gated_delta_rule(*_loop_order("kda", args), cp_context=object())
    with pytest.raises(ValueError, match="A_log"):
        fla.fused_recurrent_precond_kda(*args, A_log=jnp.zeros(1))
    with pytest.raises(ValueError, match="needs the preconditioner's `g_atk` and `beta_atk`"):
        fla.fused_recurrent_precond_gated_delta_rule(*args[:3])
    # Kernel hints are accepted and unused.
    fla.chunk_precond_kda(*args, cu_seqlens_cpu=None, solve_tril_precision="tf32")

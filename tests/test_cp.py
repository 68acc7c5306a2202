"""Context parallelism: parity with the float64 loop and the single-device kernel, payloads."""

import functools as ft

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp

from .helpers import gated_delta_reference, make_gdn_inputs, rel_err


STRATEGIES = ["allgather", "ppermute", "ring", "auto"]
# Forward-parity cases at cp != 4 that stay in the default run (the rest of the grid is `slow`).
_FAST = {("ring", 2), ("ppermute", 8), ("auto", 2)}


def _mesh(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _sharded(cp, **kwargs):
    """A jitted global-array function running the CP kernel over a `cp`-device mesh."""
    mesh = _mesh(cp)

    def per_rank(q, k, v, g, beta, h0):
        return dcp.chunk_gated_delta_rule_cp(
            q, k, v, g, beta, axis_name="cp", initial_state=h0, **kwargs
        )

    seq = P(None, "cp")
    fn = jax.jit(
        jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(seq,) * 5 + (P(),),
            out_specs=(seq, P() if kwargs.get("output_final_state") else None),
        )
    )

    def call(q, k, v, g, beta, h0):
        return fn(*_place(mesh, q, k, v, g, beta, h0))

    return call, fn


def _place(mesh, q, k, v, g, beta, h0):
    """Put global inputs on the mesh: sequence sharded over "cp", the state replicated."""
    seq = NamedSharding(mesh, P(None, "cp"))
    return [jax.device_put(x, seq) for x in (q, k, v, g, beta)] + [
        jax.device_put(h0, NamedSharding(mesh, P()))
    ]


@pytest.mark.parametrize(
    "strategy, cp",
    [
        pytest.param(s, cp, marks=() if cp == 4 or (s, cp) in _FAST else (pytest.mark.slow,))
        for s in STRATEGIES
        for cp in [2, 4, 8]
    ],
)
def test_forward_parity(getkey, cp, strategy):
    # 24 tokens per rank with chunk 16: not a multiple; r = 2 grouped heads; nonzero h0.
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=2, t=24 * cp, h=1, hv=2, dk=8, dv=6)
    call, _ = _sharded(
        cp, strategy=strategy, chunk_size=16, output_final_state=True, use_qk_l2norm=True
    )
    o, h = call(q, k, v, g, beta, h0)
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0, l2norm=True)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    single_o, single_h = dcp.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True
    )
    assert rel_err(o, single_o) <= 1e-5
    assert rel_err(h, single_h) <= 1e-5


@pytest.mark.parametrize(
    "cp, strategy",
    [(4, "allgather"), (4, "ppermute"), (4, "ring")]
    + [pytest.param(*x, marks=pytest.mark.slow) for x in [(2, "ppermute"), (8, "allgather")]],
)
def test_backward_parity(getkey, cp, strategy):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=1, t=20 * cp, h=1, hv=2, dk=8, dv=6)
    _, sharded = _sharded(cp, strategy=strategy, chunk_size=16, output_final_state=True)
    wo = np.cos(np.arange(v.size)).reshape(v.shape).astype(np.float32)
    wh = np.sin(np.arange(h0.size)).reshape(h0.shape).astype(np.float32)

    def loss(fn, *args):
        o, h = fn(*args)
        return jnp.sum(o * wo) + jnp.sum(h * wh)

    single = ft.partial(dcp.chunk_gated_delta_rule, chunk_size=16, output_final_state=True)
    args = (q, k, v, g, beta, h0)
    grads = jax.jit(jax.grad(ft.partial(loss, sharded), argnums=range(6)))(
        *_place(_mesh(cp), *args)
    )
    expected = jax.grad(
        ft.partial(loss, lambda *a: single(*a[:5], initial_state=a[5])), argnums=range(6)
    )(*args)
    for name, a, e in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, expected):
        assert rel_err(a, e) <= 1e-4, name


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_bf16_inputs(getkey, strategy):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=1, t=96, dtype=jnp.bfloat16)
    call, _ = _sharded(4, strategy=strategy, chunk_size=16, output_final_state=True)
    o, h = call(q, k, v, g, beta, h0)
    assert o.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    assert rel_err(o, expected_o) <= 2e-2
    assert rel_err(h, expected_h) <= 2e-2


def test_convenience_wrapper(getkey):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=2, t=40)
    o, h = dcp.chunk_gated_delta_rule_sharded(
        q,
        k,
        v,
        g,
        beta,
        mesh=_mesh(4),
        axis_name="cp",
        strategy="ppermute",
        initial_state=h0,
        output_final_state=True,
        chunk_size=8,
    )
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    o2, none = dcp.chunk_gated_delta_rule_sharded(
        q, k, v, g, beta, mesh=_mesh(4), axis_name="cp", initial_state=h0, chunk_size=8
    )
    assert none is None
    assert rel_err(o2, expected_o) <= 1e-5


def test_sequence_not_divisible(getkey):
    q, k, v, g, beta, _ = make_gdn_inputs(getkey(), t=30)
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by"):
        dcp.chunk_gated_delta_rule_sharded(q, k, v, g, beta, mesh=_mesh(4), axis_name="cp")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        dcp.chunk_gated_delta_rule_sharded(q, k, v, g, beta, mesh=_mesh(2), axis_name="sp")


def test_zigzag_refused(getkey, without_runtime_typecheck):
    q, k, v, g, beta, _ = make_gdn_inputs(getkey(), t=32)
    with pytest.raises(ValueError, match="contiguous, in-order slice") as info:
        dcp.chunk_gated_delta_rule_sharded(
            q, k, v, g, beta, mesh=_mesh(2), axis_name="cp", layout=dcp.Zigzag()
        )
    assert "load balancing must be off" in str(info.value)


def test_zigzag_refused_with_runtime_typecheck_on(getkey):
    # The signature admits any layout at run time so the explanation always comes through.
    q, k, v, g, beta, _ = make_gdn_inputs(getkey(), t=32)
    with pytest.raises(ValueError, match="load balancing must be off"):
        dcp.chunk_gated_delta_rule_sharded(
            q, k, v, g, beta, mesh=_mesh(2), axis_name="cp", layout=dcp.Zigzag()
        )


def test_unknown_strategy(getkey):
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), t=32)
    call, _ = _sharded(2, strategy="broadcast")
    with pytest.raises(ValueError, match="Unknown exchange strategy 'broadcast'"):
        call(q, k, v, g, beta, h0)


def _payload(cp, strategy, t, b=1, hv=2, dk=16, dv=8, final_state=False):
    q, k, v, g, beta, h0 = make_gdn_inputs(jax.random.key(0), b=b, t=t, h=1, hv=hv, dk=dk, dv=dv)
    _, fn = _sharded(cp, strategy=strategy, output_final_state=final_state)
    text = fn.lower(*_place(_mesh(cp), q, k, v, g, beta, h0)).compile().as_text()
    received = dcp.received_bytes_per_rank(text)
    return max(received.values(), default=0), dcp.collectives(text)


@pytest.mark.parametrize(
    "strategy, cp",
    [
        pytest.param(s, cp, marks=() if cp == 4 else (pytest.mark.slow,))
        for s in ["allgather", "ppermute", "ring"]
        for cp in [2, 4, 8]
    ],
)
def test_payload_is_constant_in_sequence_length(cp, strategy):
    b, hv, dk, dv = 1, 2, 16, 8
    expected = 4 * dcp.payload_elements(strategy, cp, b * hv, dk, dv)
    for s in [512, 1024, 2048, 4096]:
        got, found = _payload(cp, strategy, s)
        assert got == expected, (s, [(c.kind, c.shapes) for c in found])
    kinds = {c.kind for c in found}
    assert kinds == ({"all-gather"} if strategy == "allgather" else {"collective-permute"})


@pytest.mark.parametrize("strategy", ["allgather", "ppermute", "ring"])
def test_payload_with_final_state(strategy):
    cp, b, hv, dk, dv = 4, 1, 2, 16, 8
    got, _ = _payload(cp, strategy, 256, final_state=True)
    assert got == 4 * dcp.payload_elements(strategy, cp, b * hv, dk, dv, final_state=True)


def test_payload_formulas():
    # Received elements per rank at B*HV = 1, K = V = 128 (the DESIGN section 4 table).
    pair, state = 128 * 256, 128 * 128
    assert dcp.payload_elements("allgather", 8, 1, 128, 128) == 7 * pair
    assert dcp.payload_elements("ppermute", 8, 1, 128, 128) == 3 * pair
    assert dcp.payload_elements("ppermute", 5, 1, 128, 128) == 3 * pair
    assert dcp.payload_elements("ring", 8, 1, 128, 128) == state
    assert dcp.payload_elements("ring", 1, 1, 128, 128) == 0
    with pytest.raises(ValueError, match="Unknown exchange strategy"):
        dcp.payload_elements("tree", 8, 1, 128, 128)


def test_auto_follows_the_cost_model():
    # Two ranks: one round whatever the strategy, and the ring moves a state, not a map.
    assert dcp.choose_strategy(2, 32, 128, 128) == "ring"
    # Many ranks, plenty of bandwidth: fewer rounds wins.
    assert dcp.choose_strategy(64, 1, 16, 16, latency=1e-5, bandwidth=1e12) == "allgather"
    # Many ranks, scarce bandwidth: the ring's one state wins.
    assert dcp.choose_strategy(8, 64, 128, 128, latency=1e-6, bandwidth=1e8) == "ring"
    # Between them, the log-depth prefix.
    assert dcp.choose_strategy(64, 32, 128, 128, latency=1e-4, bandwidth=1e10) == "ppermute"
    for cp in [2, 4, 8, 16]:
        costs = {
            s: dcp.estimated_seconds(s, cp, 32, 128, 128) for s in ["allgather", "ppermute", "ring"]
        }
        assert costs[dcp.choose_strategy(cp, 32, 128, 128)] == min(costs.values())


@pytest.mark.parametrize("strategy", ["allgather", "ring"])
def test_data_and_context_parallel(getkey, strategy):
    # A 2 x 4 mesh: batch over "data", sequence over "cp".
    q, k, v, g, beta, h0 = make_gdn_inputs(getkey(), b=2, t=64, h=1, hv=2, dk=8, dv=4)
    mesh = jax.make_mesh((2, 4), ("data", "cp"))
    o, h = dcp.chunk_gated_delta_rule_sharded(
        q,
        k,
        v,
        g,
        beta,
        mesh=mesh,
        axis_name="cp",
        batch_axis="data",
        strategy=strategy,
        initial_state=h0,
        output_final_state=True,
        chunk_size=8,
    )
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5

"""Context parallelism beyond parity (which tests/test_recurrences.py checks for every
recurrence): the exchanges' payloads against the compiled HLO, their cost model, the layout
and argument checks at every context-parallel entry point, low precision across ranks."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp

from .helpers import rel_err
from .registry import exchange_id, EXCHANGES, FAMILIES, Family, GATED_DELTA_RULE, GLA


def _name(family: Family) -> str:
    return family.name


def _mesh(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _compiled_text(
    family: Family,
    cp: int,
    exchange,
    t: int,
    final_state: bool,
    layout: dcp.Layout = dcp.Contiguous(),
    **shape,
):
    """The compiled HLO of `chunk_X(..., cp=...)` over a `cp`-device mesh; without
    `final_state` the final state the function returns is left unused."""
    mesh = _mesh(cp)
    args, h0 = family.make(0, t=t, **shape)
    seq = P(None, "cp")

    def per_rank(args, h0):
        o, h = family.chunk(
            *args, initial_state=h0, cp=dcp.ContextParallel("cp", exchange=exchange, layout=layout)
        )
        return (o, h) if final_state else o

    out_specs = (seq, P()) if final_state else seq
    fn = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=((seq,) * len(args), P()), out_specs=out_specs)
    )
    placed = (
        jax.device_put(args, NamedSharding(mesh, seq)),
        jax.device_put(h0, NamedSharding(mesh, P())),
    )
    return fn.lower(*placed).compile().as_text() or ""


def _received(text: str) -> int:
    return max(dcp.internal.received_bytes_per_rank(text).values(), default=0)


DENSE = dict(b=1, h=1, hv=2, dk=16, dv=8)  # map: B HV K (K + V); state: B HV K V


def _payload(exchange, cp: int, final_state: bool = False, layout=dcp.Contiguous()) -> int:
    """Elements received per rank for the dense maps of the `DENSE` shapes."""
    b, hv, dk, dv = DENSE["b"], DENSE["hv"], DENSE["dk"], DENSE["dv"]
    return exchange.payload_elements(
        cp,
        map_elements=b * hv * dk * (dk + dv),
        state_elements=b * hv * dk * dv,
        final_state=final_state,
        layout=layout,
    )


def _layout_id(layout) -> str:
    return type(layout).__name__.lower()


# The payload and bfloat16 tests compile fast (`fast_compile_one_test`): XLA's optimisation
# passes triple the compile time and keep the collectives as they are (checked for every
# exchange at cp = 4; the diagonal-map test below keeps them on).
@pytest.mark.parametrize(
    "exchange, cp, layout",
    [
        pytest.param(ex, cp, layout, marks=() if cp == 4 else (pytest.mark.slow,))
        for ex in [dcp.AllGather(), dcp.PPermute(), dcp.Ring()]
        for cp in [2, 4, 8]
        for layout in [dcp.Contiguous(), dcp.Zigzag()]
    ],
    ids=lambda x: (
        f"cp{x}"
        if isinstance(x, int)
        else _layout_id(x)
        if isinstance(x, dcp.AbstractLayout)
        else exchange_id(x)
    ),
)
def test_payload_is_constant_in_sequence_length(exchange, cp, layout, fast_compile_one_test):
    # Bytes received per rank, read from the compiled module, equal the exchange's formula
    # at two sequence lengths 16x apart. The final state is returned and left unused: its
    # collective (an all-reduce for the ppermute and ring exchanges) must be dropped. Under
    # zigzag: two walks, the state between them broadcast by an all-reduce unless the
    # all-gather forms it locally.
    expected = 4 * _payload(exchange, cp, layout=layout)
    for t in [256, 4096]:
        text = _compiled_text(GATED_DELTA_RULE, cp, exchange, t, False, layout, **DENSE)
        found = dcp.internal.collectives(text)
        assert _received(text) == expected, (t, [(c.kind, c.shapes) for c in found])
    kinds = {c.kind for c in dcp.internal.collectives(text)}
    if isinstance(exchange, dcp.AllGather):
        assert kinds == {"all-gather"}
    elif isinstance(layout, dcp.Contiguous):
        assert kinds == {"collective-permute"}
    else:
        assert kinds == {"collective-permute", "all-reduce"}


@pytest.mark.parametrize(
    "exchange, layout",
    [
        *((ex, dcp.Contiguous()) for ex in EXCHANGES[:3]),
        (dcp.Ring(), dcp.Zigzag()),
        *(pytest.param(ex, dcp.Zigzag(), marks=pytest.mark.slow) for ex in EXCHANGES[:2]),
        *(pytest.param(x, dcp.Contiguous(), marks=pytest.mark.slow) for x in [dcp.Auto(), "ring"]),
    ],
    ids=lambda x: _layout_id(x) if isinstance(x, dcp.AbstractLayout) else exchange_id(x),
)
def test_payload_with_final_state(exchange, layout, fast_compile_one_test):
    cp = 4
    module = exchange if not isinstance(exchange, str) else dcp.Ring()
    if isinstance(module, dcp.Auto):  # the exchange it picks, for these sizes
        b, hv, dk, dv = DENSE["b"], DENSE["hv"], DENSE["dk"], DENSE["dv"]
        module = module.choose(
            cp, map_elements=b * hv * dk * (dk + dv), state_elements=b * hv * dk * dv
        )
    text = _compiled_text(GATED_DELTA_RULE, cp, exchange, 256, True, layout, **DENSE)
    assert _received(text) == 4 * _payload(module, cp, final_state=True, layout=layout)


def test_payload_is_a_diagonal_map():
    # GLA's all-gather moves (decay, U): K + K V numbers per batch element and value head,
    # not a dense map's K (K + V). Compiled with XLA's optimisations, as users run it.
    cp, b, hv, dk, dv = 4, 1, 2, 8, 6
    text = _compiled_text(GLA, cp, dcp.AllGather(), 64, False, b=b, h=1, hv=hv, dk=dk, dv=dv)
    diagonal = dcp.AllGather().payload_elements(
        cp, map_elements=b * hv * (dk + dk * dv), state_elements=b * hv * dk * dv
    )
    assert _received(text) == 4 * diagonal
    assert _received(text) == 4 * (cp - 1) * b * hv * (dk + dk * dv)


def test_payload_formulas():
    # Received elements per rank at B*HV = 1, K = V = 128 (the DESIGN section 4 table).
    pair, state = 128 * 256, 128 * 128

    def payload(ex, cp, final_state=False):
        return ex.payload_elements(
            cp, map_elements=pair, state_elements=state, final_state=final_state
        )

    assert payload(dcp.AllGather(), 8) == 7 * pair
    assert payload(dcp.PPermute(), 8) == 3 * pair
    assert payload(dcp.PPermute(), 5) == 3 * pair
    assert payload(dcp.Ring(), 8) == state
    for ex in [dcp.AllGather(), dcp.PPermute(), dcp.Ring()]:
        assert payload(ex, 1) == 0
        assert ex.rounds(1) == 0
    assert [ex.rounds(8) for ex in EXCHANGES[:3]] == [1, 3, 7]
    # The final state costs the all-gather nothing, the others one state's all-reduce.
    assert payload(dcp.AllGather(), 8, final_state=True) == 7 * pair
    for ex in [dcp.PPermute(), dcp.Ring()]:
        assert payload(ex, 8, final_state=True) > payload(ex, 8)


def _sizes(batch_heads, dk, dv) -> dict[str, Any]:
    return dict(map_elements=batch_heads * dk * (dk + dv), state_elements=batch_heads * dk * dv)


def _permute_loop_text(body_loops) -> str:
    """The compiled HLO of `body_loops(x)` over a 4-device mesh, on a float32 `(4, 8)`
    array sharded by rows (one `(8,)` row, 32 bytes, per rank)."""
    mesh = _mesh(4)
    fn = jax.jit(jax.shard_map(body_loops, mesh=mesh, in_specs=P("cp"), out_specs=P("cp")))
    x = jax.device_put(jnp.ones((4, 8), jnp.float32), NamedSharding(mesh, P("cp")))
    return fn.lower(x).compile().as_text() or ""


def _shift(x):
    return 1.5 * jax.lax.ppermute(x, "cp", [(i, (i + 1) % 4) for i in range(4)])


def test_received_bytes_count_every_trip_of_a_loop():
    # A ppermute inside a fori_loop of 5 trips moves its 32 bytes per rank 5 times; nested
    # loops (3 x 2 trips) multiply.
    text = _permute_loop_text(lambda x: jax.lax.fori_loop(0, 5, lambda i, y: _shift(y), x))
    assert dcp.internal.received_bytes_per_rank(text) == {r: 5 * 32 for r in range(4)}
    (found,) = dcp.internal.collectives(text)
    assert (found.trips, found.trips_known, found.max_received_bytes) == (5, True, 5 * 32)
    assert list(dcp.internal.loop_trips(text).values()) == [5]
    # One computation's lines without their module (no ENTRY): each collective once.
    lines = "\n".join(line.strip() for line in text.splitlines() if "collective-permute" in line)
    assert dcp.internal.received_bytes_per_rank(lines) == {r: 32 for r in range(4)}

    def nested(x):
        inner = lambda i, y: jax.lax.fori_loop(0, 2, lambda j, z: _shift(z), y)  # noqa: E731
        return jax.lax.fori_loop(0, 3, inner, x)

    text = _permute_loop_text(nested)
    assert dcp.internal.received_bytes_per_rank(text) == {r: 6 * 32 for r in range(4)}


def test_received_bytes_refuse_a_loop_of_unknown_trips():
    # A bound computed at run time: the module does not give the trips, so the total is
    # refused, and `collectives` marks its figures as a lower bound (one trip).
    def loop(x):
        n = jnp.sum(x > 0).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, lambda i, y: _shift(y), x)

    text = _permute_loop_text(loop)
    (found,) = [c for c in dcp.internal.collectives(text) if c.kind == "collective-permute"]
    assert (found.trips, found.trips_known, found.max_received_bytes) == (1, False, 32)
    with pytest.raises(ValueError, match="trip count"):
        dcp.internal.received_bytes_per_rank(text)
    assert dcp.internal.received_bytes_per_rank(text, kinds=("all-reduce",)) is not None


def test_ring_attention_bytes_count_every_step():
    # Ring attention at cp = 4: each rank receives the keys and values of the cp - 1 other
    # ranks, one block per step of its loop: (cp - 1) x 2 x S / cp x kv heads x head_dim
    # x 4 bytes (counting the loop's collective once gave a third of that).
    cp, s, kv_heads, head_dim = 4, 64, 2, 16
    att = dcp.nn.CausalSelfAttention(
        32, 4, head_dim, num_kv_heads=kv_heads, tile_size=8, key=jax.random.key(0)
    )
    mesh = _mesh(cp)
    params, static = eqx.partition(att, eqx.is_array)

    def local(params, x):
        return eqx.combine(params, static)(x, cp=dcp.ContextParallel("cp"), kv_schedule="ring")

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp")), out_specs=P("cp")))
    x = jax.device_put(jnp.ones((s, 32), jnp.float32), NamedSharding(mesh, P("cp")))
    text = fn.lower(params, x).compile().as_text() or ""
    block = (s // cp) * kv_heads * head_dim * 4  # one rank's keys (or values), in bytes
    expected = (cp - 1) * 2 * block
    assert dcp.internal.received_bytes_per_rank(text) == {r: expected for r in range(cp)}
    # Forward and backward: the backward passes the keys and values around the ring again
    # (cp - 1 steps) with their gradients' accumulators, which one more step brings home.
    grad = jax.jit(jax.grad(lambda params, x: jnp.sum(fn(params, x) ** 2)))
    text = grad.lower(params, x).compile().as_text() or ""
    permutes = dcp.internal.received_bytes_per_rank(text, kinds=("collective-permute",))
    expected = (2 * (cp - 1) + 2 * (cp - 1) + 2 * cp) * block
    assert permutes == {r: expected for r in range(cp)}


def test_auto_follows_the_cost_model():
    # Two ranks: one round whatever the exchange, and the ring moves a state, not a map.
    assert isinstance(dcp.Auto().choose(2, **_sizes(32, 128, 128)), dcp.Ring)
    # Many ranks, plenty of bandwidth: fewer rounds wins.
    fast_links = dcp.Auto(latency=1e-5, bandwidth=1e12)
    assert isinstance(fast_links.choose(64, **_sizes(1, 16, 16)), dcp.AllGather)
    # Many ranks, scarce bandwidth: the ring's one state wins.
    slow_links = dcp.Auto(latency=1e-6, bandwidth=1e8)
    assert isinstance(slow_links.choose(8, **_sizes(64, 128, 128)), dcp.Ring)
    # Between them, the log-depth prefix.
    middle = dcp.Auto(latency=1e-4, bandwidth=1e10)
    assert isinstance(middle.choose(64, **_sizes(32, 128, 128)), dcp.PPermute)
    for cp in [2, 4, 8, 16]:
        costs = {type(ex): ex.estimated_seconds(cp, **_sizes(32, 128, 128)) for ex in EXCHANGES[:3]}
        cheapest = min(costs.items(), key=lambda item: item[1])[0]
        assert type(dcp.Auto().choose(cp, **_sizes(32, 128, 128))) is cheapest


# ---------------------------------------------------------------------------------------
# Checks at every context-parallel entry point
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
def test_engine_refuses_zigzag(family):
    # The engine runs the three phases over one contiguous slice per rank; a zigzag shard
    # reaches it only as its two pieces (through `run` and the public functions). With the
    # runtime type checker on: the signature admits any layout at run time so the
    # explanation always comes through.
    args, _ = family.make(0, b=1, t=32, h=1, hv=2, dk=8, dv=6)
    recurrence = family.recurrence(chunk_size=8)
    inputs = family.inputs(*args)
    with pytest.raises(ValueError, match=r"requires layout=Contiguous\(\)") as info:
        zigzag = dcp.ContextParallel("cp", layout=dcp.Zigzag())
        dcp.internal.run_contiguous(recurrence, inputs, cp=zigzag)  # pyright: ignore[reportArgumentType]
    assert "contiguous, in-order slice per rank" in str(info.value)
    assert "Pass the ContextParallel to deltanet_cp.run" in str(info.value)


def test_engine_refuses_zigzag_without_runtime_typecheck(without_runtime_typecheck):
    args, _ = GATED_DELTA_RULE.make(0, b=1, t=32, h=1, hv=2, dk=8, dv=6)
    inputs = GATED_DELTA_RULE.inputs(*args)
    with pytest.raises(ValueError, match=r"requires layout=Contiguous\(\)"):
        dcp.internal.run_contiguous(
            dcp.GatedDeltaRule(chunk_size=8),
            inputs,
            cp=dcp.ContextParallel("cp", layout=dcp.Zigzag()),  # pyright: ignore
        )


def test_unknown_layout_refused(without_runtime_typecheck):
    args, _ = GATED_DELTA_RULE.make(0, b=1, t=32, h=1, hv=2, dk=8, dv=6)
    for bad in ["zigzag", object(), dcp.Zigzag]:
        with pytest.raises(ValueError, match=r"`layout` must be a deltanet_cp.AbstractLayout"):
            dcp.ContextParallel("cp", mesh=_mesh(2), layout=bad)  # pyright: ignore


def test_zigzag_argument_checks():
    # An odd number of tokens per rank, or a global length not a multiple of 2 cp.
    args, _ = GATED_DELTA_RULE.make(0, b=1, t=24, h=1, hv=2, dk=8, dv=6)
    with pytest.raises(ValueError, match=r"must be divisible by 16 .* layout=Zigzag\(\)"):
        dcp.chunk_gated_delta_rule(
            *args, cp=dcp.ContextParallel("cp", mesh=_mesh(8), layout=dcp.Zigzag())
        )
    mesh = _mesh(8)
    seq = P(None, "cp")

    def per_rank(args):
        return dcp.chunk_gated_delta_rule(*args, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag()))[
            0
        ]

    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=((seq,) * len(args),), out_specs=seq)
    with pytest.raises(ValueError, match="local sequence length must be even; got 3"):
        jax.eval_shape(fn, jax.device_put(args, NamedSharding(mesh, seq)))
    with pytest.raises(ValueError, match="divisible by 2 \\* cp = 16"):
        dcp.to_zigzag(args[0], 8)


def test_to_and_from_zigzag():
    x = jnp.arange(2 * 24).reshape(2, 24)
    z = dcp.to_zigzag(x, 3)
    pieces = [list(range(4 * p, 4 * p + 4)) for p in [0, 5, 1, 4, 2, 3]]
    assert z[0].tolist() == sum(pieces, [])
    assert (dcp.from_zigzag(z, 3) == x).all()
    assert (dcp.from_zigzag(dcp.to_zigzag(x.T, 2, axis=0), 2, axis=0) == x.T).all()
    assert (dcp.to_zigzag(x, 1) == x).all()


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
def test_unknown_exchange(family, without_runtime_typecheck):
    # (With the runtime type checker on, the `Literal` of the shorthands refuses it first.)
    args, _ = family.make(0, b=1, t=32, h=1, hv=2, dk=8, dv=6)
    mesh = _mesh(2)
    seq = P(None, "cp")

    def per_rank(args):
        bad = dcp.ContextParallel("cp", exchange="broadcast")  # pyright: ignore
        return family.chunk(*args, cp=bad)[0]

    fn = jax.shard_map(per_rank, mesh=mesh, in_specs=((seq,) * len(args),), out_specs=seq)
    placed = jax.device_put(args, NamedSharding(mesh, seq))
    with pytest.raises(ValueError, match="Unknown exchange 'broadcast'"):
        jax.eval_shape(fn, placed)
    with pytest.raises(ValueError, match="Unknown exchange 'broadcast'"):
        family.chunk(
            *args,
            cp=dcp.ContextParallel("cp", mesh=mesh, exchange="broadcast"),  # pyright: ignore
        )


def test_sharded_argument_checks():
    args, _ = GATED_DELTA_RULE.make(0, b=1, t=30, h=1, hv=2, dk=8, dv=6)
    with pytest.raises(ValueError, match=r"sequence length \(30\) must be divisible by"):
        dcp.chunk_gated_delta_rule(*args, cp=dcp.ContextParallel("cp", mesh=_mesh(4)))
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        dcp.chunk_gated_delta_rule(*args, cp=dcp.ContextParallel("sp", mesh=_mesh(2)))


@pytest.mark.parametrize(
    "exchange", [dcp.AllGather(), pytest.param(dcp.Ring(), marks=pytest.mark.slow)], ids=exchange_id
)
def test_bf16_inputs_across_ranks(exchange, fast_compile_one_test):
    family = GATED_DELTA_RULE
    args, h0 = family.make(1, b=1, t=96, h=2, hv=4, dk=16, dv=8, dtype=jnp.bfloat16)
    o, h = family.chunk(
        *args,
        initial_state=h0,
        chunk_size=16,
        cp=dcp.ContextParallel("cp", mesh=_mesh(4), exchange=exchange),
    )
    assert o.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    expected_o, expected_h = family.reference(*args, initial_state=h0)
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    assert rel_err(o, expected_o) <= 2e-2
    assert rel_err(h, expected_h) <= 2e-2


# ---------------------------------------------------------------------------------------
# Eager differentiation through `_sharded` on a default mesh (issue 19, item 10)
# ---------------------------------------------------------------------------------------


# Zigzag in the slow suite (each layout compiles its own programs, 9 to 14 s).
@pytest.mark.parametrize(
    "layout", [dcp.Contiguous(), pytest.param(dcp.Zigzag(), marks=pytest.mark.slow)], ids=repr
)
def test_eager_grad_through_sharded_on_a_default_mesh(layout):
    # `jax.make_mesh` gives Explicit axes; eager `jax.grad` of a loss of the outputs failed
    # with "enter your `jit` into a mesh context via `jax.set_mesh`" (and `set_mesh` is
    # refused under a trace, so the library can't enter it for the caller).
    family = GATED_DELTA_RULE
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
    args, h0 = family.make(0, b=1, t=16, h=1, hv=2, dk=8, dv=6)

    def loss(fn, q):
        o, h = fn(q, *args[1:], initial_state=h0)
        return (o**2).sum() + h.sum()

    sharded = ft.partial(family.chunk, cp=dcp.ContextParallel("cp", mesh=mesh, layout=layout))
    grad = jax.grad(ft.partial(loss, ft.partial(sharded, chunk_size=4)))(args[0])
    expected = jax.grad(ft.partial(loss, ft.partial(family.chunk, chunk_size=4)))(args[0])
    assert rel_err(grad, expected) <= 1e-5
    # The engine's own entry point, and with a batch axis on a 2-D mesh.
    mesh2 = jax.make_mesh((2, 2), ("data", "cp"), devices=jax.devices()[:4])
    b_args, b_h0 = family.make(1, b=2, t=16, h=1, hv=2, dk=8, dv=6)

    def engine_loss(q):
        inputs = family.inputs(q, *b_args[1:])
        o, h = dcp.run(
            family.recurrence(chunk_size=4),
            inputs,
            initial_state=b_h0,
            cp=dcp.ContextParallel("cp", mesh=mesh2, batch_axis="data", layout=layout),
        )
        assert h is not None
        return (o**2).sum() + h.sum()

    def one_device_loss(q):
        o, h = family.chunk(q, *b_args[1:], initial_state=b_h0)
        return (o**2).sum() + h.sum()

    assert rel_err(jax.grad(engine_loss)(b_args[0]), jax.grad(one_device_loss)(b_args[0])) <= 1e-5


# Slow (each layout compiles its own programs, 9 to 14 s): the default run checks packed
# documents under cp inside `shard_map` and global arrays on an explicit mesh apart.
@pytest.mark.slow
@pytest.mark.parametrize("layout", [dcp.Contiguous(), dcp.Zigzag()], ids=repr)
def test_packed_documents_on_arrays_placed_on_an_explicit_mesh(layout):
    # The ordinary packed-documents training path: arrays the caller placed on a
    # `jax.make_mesh` mesh (`Explicit` axes), a jitted gradient, `mesh=` ContextParallel.
    # The engine ran on an `Auto` copy of the mesh and JAX refused the mix ("mesh should be
    # the same across the entire program"); it now runs on the caller's mesh, and the
    # outputs come back typed on it. Cost: two programs of cp=4 (about 10 s cold).
    family = GATED_DELTA_RULE
    mesh = _mesh(4)
    cp = dcp.ContextParallel("cp", mesh=mesh, layout=layout)
    args, _ = family.make(5, b=1, t=64, h=1, hv=2, dk=8, dv=6)
    cu_seqlens = jnp.array([0, 9, 40, 64], jnp.int32)
    placed = [jax.device_put(a, NamedSharding(mesh, P(None, "cp"))) for a in args]

    def loss(args, cp):
        o, h = family.chunk(*args, chunk_size=4, cu_seqlens=cu_seqlens, cp=cp)
        return (o**2).sum() + (h * h[::-1]).sum(), (o, h)

    step = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, (o, h)), grads = step(placed, cp)
    (_, (want_o, want_h)), want = jax.value_and_grad(loss, has_aux=True)(list(args), None)
    assert o.sharding.mesh == mesh and grads[0].sharding.mesh == mesh
    assert rel_err(o, want_o) <= 1e-5 and rel_err(h, want_h) <= 1e-5
    for got, expected in zip(grads, want):
        assert rel_err(got, expected) <= 1e-5
    # Eagerly the outputs are on the caller's mesh too, so they meet its arrays.
    o, _ = family.chunk(*placed, chunk_size=4, cu_seqlens=cu_seqlens, cp=cp)
    assert o.sharding.mesh == mesh
    assert rel_err(o + placed[0][..., :1], want_o + args[0][..., :1]) <= 1e-5


def test_mesh_to_run_on():
    from deltanet_cp._mesh import mesh_to_run_on

    explicit = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    auto = mesh_to_run_on(explicit)
    assert auto.axis_types == (jax.sharding.AxisType.Auto,)
    assert auto.axis_names == explicit.axis_names and (auto.devices == explicit.devices).all()
    assert mesh_to_run_on(auto) is auto
    # Arrays typed on the Explicit mesh: the call runs on it as it is.
    placed = jax.device_put(jnp.ones((2, 4)), NamedSharding(explicit, P(None, "cp")))
    assert mesh_to_run_on(explicit, None, [jnp.ones(3), placed]) is explicit
    assert mesh_to_run_on(explicit, jnp.ones(3)) == auto
    # Inside a mesh context the caller uses sharding in types: the mesh is kept.
    with jax.set_mesh(explicit):
        assert mesh_to_run_on(explicit) is explicit


def test_context_parallel_arguments(without_runtime_typecheck):
    # One static value: equal configurations are equal and hash alike (one compilation),
    # shorthands become exchange modules, and every bad argument names itself.
    mesh = _mesh(2)
    cp = dcp.ContextParallel("cp", exchange="ring", mesh=mesh)
    assert cp == dcp.ContextParallel("cp", exchange=dcp.Ring(), mesh=_mesh(2))
    assert hash(cp) == hash(dcp.ContextParallel("cp", exchange="ring", mesh=_mesh(2)))
    assert cp.exchange == dcp.Ring() and cp.layout == dcp.Contiguous()
    assert jax.tree.leaves(cp) == []  # nothing traced: safe to close over or pass to jit
    with pytest.raises(TypeError, match="`axis_name` must be a mesh axis name"):
        dcp.ContextParallel(3)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`batch_axis` .* pass a `mesh` that has it"):
        dcp.ContextParallel("cp", batch_axis="data")
    with pytest.raises(ValueError, match="`batch_axis` .* pass a `mesh` that has it"):
        dcp.ContextParallel("cp", mesh=mesh, batch_axis="data")
    args, _ = GATED_DELTA_RULE.make(0, b=1, t=32, h=1, hv=2, dk=8, dv=6)
    inputs = GATED_DELTA_RULE.inputs(*args)
    for bad in ["cp", 2, ("cp", dcp.Zigzag())]:
        with pytest.raises(TypeError, match="`cp` must be a deltanet_cp.ContextParallel or None"):
            dcp.chunk_gated_delta_rule(*args, cp=bad)  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError, match="`cp` must be a deltanet_cp.ContextParallel or None"):
            dcp.run(dcp.GatedDeltaRule(), inputs, cp=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="run_contiguous runs inside jax.shard_map"):
        dcp.internal.run_contiguous(dcp.GatedDeltaRule(), inputs, cp=cp)  # pyright: ignore

"""Bad inputs at every public entry point (issue 19): each is refused with a `TypeError` or
a `ValueError` whose message names the argument, instead of an `AttributeError` or a
`ZeroDivisionError` from deep inside or a silently different computation; and values that
are integers or floats in all but their Python type (`np.int64(8)`, a concrete 0-d array)
are accepted.

Over the registry: every recurrence x each of its four public functions (`chunk_X`,
`recurrent_X`, `chunk_X(cp=...)` inside `jax.shard_map` and on global arrays) x each kind of bad
input; then the engine's entry points, the zigzag helpers and the layers. Without the runtime
type checker where it would answer first: these are the errors a user without it gets.
"""

import functools as ft
import os
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp._recurrence import check_inputs, inputs_type
from deltanet_cp._validate import as_index, as_scale
from deltanet_cp.interop import fla
from deltanet_cp.nn import CausalConv1d, CausalSelfAttention, GatedDeltaNet, HybridLM

from . import _stall
from .helpers import make_delta_product_inputs, pairwise
from .registry import FAMILIES, Family, GLA, GLA_PER_HEAD


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


SHAPE = dict(b=1, t=8, h=1, hv=2, dk=4, dv=4)
CHUNK = 4
ENTRY_POINTS = ["chunk", "recurrent", "chunk_per_rank", "chunk_global"]
CHUNKED = ["chunk", "chunk_per_rank", "chunk_global"]  # the ones with a `chunk_size`


def _name(family: Family) -> str:
    return family.name


def _mesh(cp: int = 2) -> jax.sharding.Mesh:
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _call(family: Family, entry: str, args, **kw) -> Any:
    """The outputs of one public entry point on global `args` (over 2 devices for CP)."""
    if entry == "chunk_per_rank":
        mesh, seq = _mesh(), P(None, "cp")

        def per_rank(args):
            return family.chunk(*args, **kw, cp=dcp.ContextParallel("cp"))[0]

        fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,), out_specs=seq)
        return fn(jax.device_put(args, NamedSharding(mesh, seq)))
    if entry == "chunk_global":
        return family.chunk(*args, **kw, cp=dcp.ContextParallel("cp", mesh=_mesh()))[0]
    return getattr(family, entry)(*args, **kw)[0]


def _options(entry: str, **kw) -> dict[str, Any]:
    return dict(kw, chunk_size=CHUNK) if entry in CHUNKED else kw


def _cases(marks=lambda family, entry: []):
    """`(family, entry)` for every family and entry point, with `marks(family, entry)`."""
    return [
        pytest.param(family, entry, marks=marks(family, entry), id=f"{family.name}-{entry}")
        for family in FAMILIES
        for entry in ENTRY_POINTS
    ]


def _is_gla(family: Family) -> bool:
    return family in (GLA, GLA_PER_HEAD)


def _families_with_converters():
    return [pytest.param(family, id=family.name) for family in FAMILIES]


# ---------------------------------------------------------------------------------------
# Every recurrence x every public function
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, entry", _cases())
def test_empty_key_axis(family, entry, without_runtime_typecheck):
    # K = 0 divided by zero in the default scale K ** -0.5.
    args, _ = family.make(0, **dict(SHAPE, dk=0))
    with pytest.raises(ValueError, match=r"`q` has shape \(1, \d+, 1, 0\), with an empty axis"):
        _call(family, entry, args, **_options(entry))


@pytest.mark.parametrize("family, entry", _cases())
def test_missing_array(family, entry, without_runtime_typecheck):
    # The last argument that has no default (`beta`, GLA's `g`, the momentum rule's
    # `log_mu`) as None: was an AttributeError on `None`.
    args, _ = family.make(0, **SHAPE)
    i = max(i for i, n in enumerate(family.arg_names) if n not in family.optional)
    name = family.arg_names[i]
    with pytest.raises(ValueError, match=f"`{name}`"):
        _call(family, entry, (*args[:i], None, *args[i + 1 :]), **_options(entry))


@pytest.mark.parametrize(
    "family, entry, chunk_size",
    # Every pair of a family, an entry point and a bad value (not the whole product).
    pairwise([FAMILIES, CHUNKED, [4.0, "4", True, None]], ids=[_name, str, str], slow_cover=[]),
)
def test_chunk_size_not_an_int(family, entry, chunk_size, without_runtime_typecheck):
    args, _ = family.make(0, **SHAPE)
    with pytest.raises((TypeError, ValueError), match="`chunk_size`"):
        _call(family, entry, args, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "family, entry",
    _cases(),
)
def test_integer_and_float_like_values_accepted(family, entry, without_runtime_typecheck):
    # np.int64 as `chunk_size` and a concrete 0-d array as `scale` are converted to the
    # Python int and float they hold: the same configuration, the same compiled program.
    args, _ = family.make(0, **SHAPE)
    expected = _call(family, entry, args, **_options(entry, scale=0.5))
    like = dict(scale=jnp.float32(0.5))
    if entry in CHUNKED:
        like["chunk_size"] = np.int64(CHUNK)
    assert (_call(family, entry, args, **like) == expected).all()


@pytest.mark.parametrize("family, entry", _cases())
def test_traced_scale(family, entry, without_runtime_typecheck):
    # A traced scale can't be part of the static configuration: refused, with the way out.
    args, _ = family.make(0, **SHAPE)
    call = jax.jit(lambda s: _call(family, entry, args, **_options(entry, scale=s)))
    with pytest.raises(TypeError, match=r"`scale` must be a Python float .* `scale=1.0`"):
        call(0.5)


@pytest.mark.parametrize("family", _families_with_converters())
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_non_finite_scale(family, scale):
    args, _ = family.make(0, **SHAPE)
    with pytest.raises(ValueError, match="`scale` must be finite"):
        family.chunk(*args, scale=scale, chunk_size=CHUNK)


def test_the_way_round_a_traced_scale():
    # What the message says: the outputs are linear in the scale.
    family = FAMILIES[0]
    args, h0 = family.make(0, **SHAPE)

    @jax.jit
    def scaled(s):
        o, h = family.chunk(*args, scale=1.0, initial_state=h0)
        return o * s, h

    o, h = family.chunk(*args, scale=0.3, initial_state=h0)
    o_traced, h_traced = scaled(jnp.float32(0.3))
    np.testing.assert_allclose(o_traced, o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(h_traced, h, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------
# The engine: dcp.run (one device and global arrays), dcp.internal.run_contiguous
# ---------------------------------------------------------------------------------------


def _engine(entry: str, recurrence, inputs):
    if entry == "run_global":
        return dcp.run(recurrence, inputs, cp=dcp.ContextParallel("cp", mesh=_mesh()))
    run = {"run": dcp.run, "run_contiguous": dcp.internal.run_contiguous}[entry]
    return run(recurrence, inputs)


ENGINE_ENTRY_POINTS = ["run", "run_contiguous", "run_global"]


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
@pytest.mark.parametrize("entry", ENGINE_ENTRY_POINTS)
def test_engine_inputs_of_the_wrong_type(family, entry, without_runtime_typecheck):
    args, _ = family.make(0, **SHAPE)
    recurrence = family.recurrence(chunk_size=CHUNK)
    expected = inputs_type(type(recurrence))
    assert expected is not None
    pattern = rf"takes `inputs` of type {expected.__name__}; got {{}}\. Build them as"
    with pytest.raises(TypeError, match=pattern.format("tuple")):
        _engine(entry, recurrence, tuple(args))
    # The other family's inputs, with arrays of plausible shapes.
    q, k, v, *_ = args
    g = jnp.zeros(v.shape[:3])
    other = dcp.DeltaInputs(q, k, v, g, g) if _is_gla(family) else dcp.GLAInputs(q, k, v, g)
    with pytest.raises(TypeError, match=pattern.format(type(other).__name__)):
        _engine(entry, recurrence, other)


@pytest.mark.parametrize("entry", ENGINE_ENTRY_POINTS)
def test_engine_recurrence_of_the_wrong_type(entry, without_runtime_typecheck):
    family = FAMILIES[0]
    inputs = family.inputs(*family.make(0, **SHAPE)[0])
    with pytest.raises(TypeError, match="`recurrence` must be a deltanet_cp.AbstractRecurrence"):
        _engine(entry, "gated_delta_rule", inputs)


def test_check_inputs(without_runtime_typecheck):
    # Directly, whether or not the engine calls it yet.
    q = k = v = jnp.zeros((1, 8, 1, 4))
    g = beta = jnp.zeros((1, 8, 1))
    rule = dcp.GatedDeltaRule()
    check_inputs(rule, dcp.DeltaInputs(q, k, v, g, beta))
    check_inputs(dcp.DeltaRule(), dcp.DeltaInputs(q, k, v, None, beta))  # `g` may be None
    check_inputs(dcp.GLARule(), dcp.GLAInputs(q, k, v, g))
    with pytest.raises(TypeError, match="GatedDeltaRule takes `inputs` of type DeltaInputs"):
        check_inputs(rule, (q, k, v, g, beta))
    fields = r"deltanet_cp.DeltaInputs\(q, k, v, g, beta, write, write_key\)"
    with pytest.raises(TypeError, match=fields):
        check_inputs(rule, dcp.GLAInputs(q, k, v, g))
    with pytest.raises(TypeError, match=r"deltanet_cp.GLAInputs\(q, k, v, g\)"):
        check_inputs(dcp.GLARule(), dcp.DeltaInputs(q, k, v, g, beta))
    with pytest.raises(TypeError, match="`recurrence`"):
        check_inputs(None, dcp.DeltaInputs(q, k, v, g, beta))
    with pytest.raises(ValueError, match="DeltaRule needs `beta`, an array; got None"):
        no_beta: Any = None
        check_inputs(dcp.DeltaRule(), dcp.DeltaInputs(q, k, v, None, no_beta))
    with pytest.raises(ValueError, match=r"`k` has shape \(1, 8, 1, 0\), with an empty axis"):
        check_inputs(rule, dcp.DeltaInputs(q, k[..., :0], v, g, beta))
    # Gated DeltaProduct with no Householder step per token.
    kk, vv, bb = k[:, :, None][:, :, :0], v[:, :, None][:, :, :0], beta[:, :, None][:, :, :0]
    with pytest.raises(ValueError, match=r"`k` has shape \(1, 8, 0, 1, 4\)"):
        check_inputs(dcp.GatedDeltaProductRule(), dcp.DeltaInputs(q, kk, vv, g, bb))
    # An empty batch or sequence is not a problem of the heads or features.
    check_inputs(rule, dcp.DeltaInputs(q[:0], k[:0], v[:0], g[:0], beta[:0]))
    check_inputs(rule, dcp.DeltaInputs(q[:, :0], k[:, :0], v[:, :0], g[:, :0], beta[:, :0]))


def test_inputs_type_of_every_recurrence():
    for family in FAMILIES:
        recurrence = family.recurrence()
        expected = type(family.inputs(*family.make(0, **SHAPE)[0]))
        assert inputs_type(type(recurrence)) is expected


@pytest.mark.parametrize("family", _families_with_converters())
def test_recurrence_configuration(family, without_runtime_typecheck):
    recurrence = family.recurrence(chunk_size=np.int64(16), scale=np.float32(0.25))
    assert type(recurrence.chunk_size) is int and recurrence.chunk_size == 16
    assert type(recurrence.scale) is float and recurrence.scale == 0.25
    assert recurrence == family.recurrence(chunk_size=16, scale=0.25)
    assert family.recurrence(scale=None).scale is None
    for bad in [16.0, "16", True]:
        with pytest.raises(TypeError, match="`chunk_size` must be an int"):
            family.recurrence(chunk_size=bad)
    for bad in ["0.5", True, jnp.ones(2)]:
        with pytest.raises(TypeError, match="`scale` must be a float or None"):
            family.recurrence(scale=bad)


def test_as_index_and_as_scale(without_runtime_typecheck):
    assert as_index(np.int64(3), "n") == 3 and as_index(jnp.int32(3), "n") == 3
    assert type(as_index(np.int32(3), "n")) is int
    for bad in [3.0, "3", np.bool_(True), None]:
        with pytest.raises(TypeError, match="`n` must be an int"):
            as_index(bad, "n")
    with pytest.raises(TypeError, match="`n` must be a Python int known when tracing"):
        jax.jit(lambda n: as_index(n, "n"))(3)
    assert as_scale(1) == 1.0 and as_scale(np.float64(0.5)) == 0.5 and as_scale(None) is None
    assert as_scale(jnp.asarray(0.5)) == 0.5


# ---------------------------------------------------------------------------------------
# dcp.to_zigzag, dcp.from_zigzag
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [dcp.to_zigzag, dcp.from_zigzag], ids=lambda f: f.__name__)
def test_zigzag_axis(fn, without_runtime_typecheck):
    x = jnp.arange(2 * 3 * 8).reshape(2, 3, 8)
    # Negative axes in range count from the end, as in numpy.
    assert (fn(x, 2, axis=-1) == fn(x, 2, axis=2)).all()
    assert (fn(x.swapaxes(0, 2), 2, axis=-3) == fn(x.swapaxes(0, 2), 2, axis=0)).all()
    # Out of range: numpy's AxisError (a ValueError and an IndexError), not a wrapped axis
    # (`axis=3` on a 3-D array used to act as `axis=0`).
    for axis in [3, -4, 7]:
        with pytest.raises(np.exceptions.AxisError, match=f"`axis`: axis {axis} is out of bounds"):
            fn(x, 2, axis=axis)
    with pytest.raises(TypeError, match="`axis` must be an int"):
        fn(x, 2, axis=2.0)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("fn", [dcp.to_zigzag, dcp.from_zigzag], ids=lambda f: f.__name__)
def test_zigzag_cp(fn, without_runtime_typecheck):
    x = jnp.arange(2 * 8).reshape(2, 8)
    expected = fn(x, 2)
    assert (fn(x, np.int64(2)) == expected).all()
    assert (fn(x, jnp.int32(2)) == expected).all()
    for bad in [2.0, "2", True]:
        with pytest.raises(TypeError, match="`cp` must be an int"):
            fn(x, bad)
    for bad in [0, -2]:
        with pytest.raises(ValueError, match="`cp` must be a positive int"):
            fn(x, bad)


# ---------------------------------------------------------------------------------------
# The layers
# ---------------------------------------------------------------------------------------


@ft.cache
def _layer() -> GatedDeltaNet:
    return GatedDeltaNet(16, 1, 2, 4, 4, chunk_size=4, key=jr.key(0))


def test_layer_refuses_a_batch(without_runtime_typecheck):
    layer = _layer()
    x = jnp.zeros((3, 8, 16))
    with pytest.raises(ValueError, match=r"`x` must have shape \(seq, hidden\) .* `jax.vmap`"):
        layer(x)
    with pytest.raises(ValueError, match=r"`x` must have shape \(seq, hidden\)"):
        layer.recurrence_inputs(x)
    with pytest.raises(ValueError, match=r"hidden = 16; got \(8, 12\)"):
        layer(jnp.zeros((8, 12)))
    with pytest.raises(ValueError, match=r"`x` must have shape \(hidden,\)"):
        layer.step(jnp.zeros((2, 16)), layer.init_state())
    with pytest.raises(ValueError, match="`x` must be a floating-point array"):
        layer(jnp.zeros((8, 16), jnp.int32))


def test_layer_sizes(without_runtime_typecheck):
    sizes: Any = (np.int64(16), 1, np.int32(2), 4, 4)
    chunk_size: Any = np.int64(4)
    layer = GatedDeltaNet(*sizes, chunk_size=chunk_size, key=jr.key(0))
    assert eqx.tree_equal(layer, _layer())
    with pytest.raises(TypeError, match="`hidden_size` must be an int"):
        GatedDeltaNet(16.5, 1, 2, 4, 4, key=jr.key(0))  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`key_head_dim` must be a positive int"):
        GatedDeltaNet(16, 1, 2, 0, 4, key=jr.key(0))
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        GatedDeltaNet(16, 1, 2, 4, 4, chunk_size=0, key=jr.key(0))


@ft.cache
def _model() -> HybridLM:
    return HybridLM(11, 16, 2, attention_every=2, chunk_size=4, key=jr.key(0))


def test_hybrid_sizes(without_runtime_typecheck):
    with pytest.raises(ValueError, match="`attention_every` must be a positive int; got 0"):
        HybridLM(11, 16, 2, attention_every=0, key=jr.key(0))
    with pytest.raises(TypeError, match="`vocab_size` must be an int"):
        HybridLM(11.0, 16, 2, key=jr.key(0))  # pyright: ignore[reportArgumentType]
    vocab: Any = np.int64(11)
    every: Any = np.int64(2)
    model = HybridLM(vocab, 16, 2, attention_every=every, chunk_size=4, key=jr.key(0))
    assert eqx.tree_equal(model, _model())


def test_hybrid_out_of_vocabulary_tokens():
    # Was: the embedding clamped an id of `vocab_size` or -1 to the last id, silently.
    model = _model()
    good = jnp.asarray([0, 3, 10, 5], jnp.int32)
    call = eqx.filter_jit(lambda m, t: m(t))  # one program for the good and the bad ids
    assert call(model, good).shape == (4, 11)
    for bad in [11, -1]:
        tokens = good.at[2].set(bad)
        # Concrete ids: a ValueError naming the id and its position; traced ones fail the
        # computation (`equinox.error_if`).
        with pytest.raises(
            ValueError, match=rf"`tokens` must be ids in \[0, vocab_size = 11\); got {bad} at pos"
        ):
            model(tokens)
        with pytest.raises(Exception, match=r"`tokens` must be ids in \[0, vocab_size = 11\)"):
            jax.block_until_ready(call(model, tokens))


_OUT_OF_VOCABULARY_UNDER_CP = """
import jax
import jax.numpy as jnp
import jax.random as jr
import equinox as eqx
from jax.sharding import NamedSharding, PartitionSpec as P
import deltanet_cp as dcp
from deltanet_cp.nn import HybridLM

model = HybridLM(11, 16, 2, attention_every=2, chunk_size=4, key=jr.key(0))
mesh = jax.make_mesh((2,), ("cp",))
seq = P(None, "cp")
fn = eqx.filter_jit(jax.shard_map(
    lambda m, t: jax.vmap(lambda x: m(x, cp=dcp.ContextParallel("cp")))(t),
    mesh=mesh, in_specs=(P(), seq), out_specs=seq,
))
tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 11
assert fn(model, jax.device_put(tokens, NamedSharding(mesh, seq))).shape == (2, 8, 11)
bad = tokens.at[1, 6].set(11)  # on rank 1 only
try:
    jax.block_until_ready(fn(model, jax.device_put(bad, NamedSharding(mesh, seq))))
except Exception as e:
    print("RAISED", type(e).__name__, "`tokens` must be ids" in str(e))
else:
    print("NO ERROR")
"""


@pytest.mark.slow  # 10 s in a fresh process under cp; out-of-vocabulary ids are checked
# in the default run by test_models_inputs.py
def test_hybrid_out_of_vocabulary_tokens_under_cp():
    # One rank's bad id must fail every rank (alone, it would leave the others waiting in
    # their next collective). In a fresh process, as in tests/test_recurrences.py: once an
    # `eqx.error_if` has fired inside `shard_map`, JAX's runtime tokens of the process stay
    # failed.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=2"]),
    }
    result = _stall.run([sys.executable, "-c", _OUT_OF_VOCABULARY_UNDER_CP], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-3:] == ["RAISED", "EquinoxRuntimeError", "True"], (
        result.stdout + result.stderr[-3000:]
    )


def test_hybrid_token_types(without_runtime_typecheck):
    model = _model()
    with pytest.raises(ValueError, match="`tokens` must be a 1-D integer array"):
        model(jnp.asarray([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=r"`tokens` must be a 1-D integer array .*`jax.vmap`"):
        model(jnp.zeros((2, 4), jnp.int32))


# ---------------------------------------------------------------------------------------
# Empty inputs and cu_seqlens beyond int32
# ---------------------------------------------------------------------------------------


def _call_with_state(family: Family, entry: str, args, **kw):
    """`(outputs, final_state)` of one public entry point (over 2 devices for CP)."""
    if entry == "chunk_per_rank":
        mesh, seq = _mesh(), P(None, "cp")

        def per_rank(args):
            return family.chunk(*args, **kw, cp=dcp.ContextParallel("cp"))

        fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,), out_specs=(seq, P()))
        return fn(jax.device_put(args, NamedSharding(mesh, seq)))
    if entry == "chunk_global":
        return family.chunk(*args, **kw, cp=dcp.ContextParallel("cp", mesh=_mesh()))
    return getattr(family, entry)(*args, **kw)


def _empty_marks(family: Family, entry: str) -> list:
    # Every family on one device, every entry point for the gated delta rule; the other
    # families' context-parallel entry points (a compile each) in the slow run.
    cp = entry in ("chunk_per_rank", "chunk_global")
    return [pytest.mark.slow] if cp and family.name != "gated_delta_rule" else []


@pytest.mark.parametrize("family, entry", _cases(_empty_marks))
def test_empty_sequence_or_batch(family, entry):
    # As flash-linear-attention and torch do: empty outputs, and the initial state (zeros
    # if none is given; per document with `cu_seqlens`) as the final state.
    args, h0 = family.make(0, **SHAPE)
    hv, dv = SHAPE["hv"], SHAPE["dv"]
    cases = [(1, 0)] if entry in ("chunk_per_rank", "chunk_global") else [(1, 0), (0, 5)]
    for b, t in cases:
        empty = [x[:b, :t] for x in args]
        o, final = _call_with_state(family, entry, empty, **_options(entry))
        assert o.shape == (b, t, hv, dv) and o.dtype == args[2].dtype, (b, t)
        assert final.shape == (b, *h0.shape[1:]) and not np.any(final), (b, t)
        o, final = _call_with_state(family, entry, empty, initial_state=h0[:b], **_options(entry))
        assert o.shape == (b, t, hv, dv), (b, t)
        assert np.array_equal(final, h0[:b]), (b, t)
    # Packed documents, all empty: each document's final state is its initial state.
    docs = jnp.stack([h0[0], 2 * h0[0]])
    empty = [x[:, :0] for x in args]
    o, final = _call_with_state(
        family, entry, empty, initial_state=docs, cu_seqlens=[0, 0, 0], **_options(entry)
    )
    assert o.shape == (1, 0, hv, dv)
    assert np.array_equal(final, docs)


def test_run_contiguous_refuses_an_empty_slice():
    args, _ = GLA.make(0, **SHAPE)
    with pytest.raises(ValueError, match="run_contiguous"):
        dcp.internal.run_contiguous(GLA.configuration(CHUNK), GLA.inputs(*[x[:, :0] for x in args]))


@pytest.mark.parametrize(
    "cu_seqlens",
    [
        [0, 2**33, 8],
        np.array([0, 2**33, 8], np.int64),
        np.array([0, -(2**31) - 1, 8], np.int64),
    ],
    ids=["list", "int64", "negative"],
)
def test_cu_seqlens_beyond_int32(cu_seqlens, without_runtime_typecheck):
    # Converted to int32 they would wrap round (2**33 becomes 0) and run as other documents.
    family = FAMILIES[0]
    args, _ = family.make(0, **SHAPE)
    with pytest.raises(ValueError, match="`cu_seqlens` holds .* does not fit in int32"):
        family.chunk(*args, cu_seqlens=cu_seqlens, chunk_size=CHUNK)


def test_traced_cu_seqlens_of_a_wide_dtype(without_runtime_typecheck):
    # Its values cannot be seen when tracing: its dtype is refused.
    family = FAMILIES[0]
    args, _ = family.make(0, **SHAPE)
    fn = jax.jit(lambda cu: family.chunk(*args, cu_seqlens=cu, chunk_size=CHUNK))
    with jax.enable_x64(True):
        with pytest.raises(ValueError, match="traced `cu_seqlens`.*int64"):
            fn(jnp.asarray([0, 3, 8], jnp.int64))
    with pytest.raises(ValueError, match="traced `cu_seqlens`.*uint32"):
        fn(jnp.asarray([0, 3, 8], jnp.uint32))
    # Within int32: accepted, concrete or traced.
    family.chunk(*args, cu_seqlens=np.array([0, 3, 8], np.int64), chunk_size=CHUNK)
    fn(jnp.asarray([0, 3, 8], jnp.int32))


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.l2norm], ids=_name)
@pytest.mark.parametrize("flag", ["no", "false", 0, 1, None])
def test_use_qk_l2norm_must_be_a_bool(family, flag):
    # A string would read as true (and normalise); only a bool is a flag.
    with pytest.raises(ValueError, match="use_qk_l2norm"):
        family.recurrence(chunk_size=8, use_qk_l2norm=flag)
    assert family.recurrence(chunk_size=8, use_qk_l2norm=np.bool_(True)).use_qk_l2norm is True


# ---------------------------------------------------------------------------------------
# One rule for every count and size: `as_positive_index`
# ---------------------------------------------------------------------------------------


def _delta_product_flat(n: int):
    """FLA's flat layout for `chunk_gated_delta_product`: 4 tokens of `n` steps each."""
    (q, k, v, g, beta), _ = make_delta_product_inputs(0, t=4, n=2)
    flat = [x.reshape(1, 8, *x.shape[3:]) for x in (k, v, beta)]
    return fla.chunk_gated_delta_product(q, flat[0], flat[1], g, flat[2], n)[0]


def _run_gla(entry: str, block_size: int):
    args, _ = GLA.make(0, **SHAPE)
    run = {"run": dcp.run, "run_contiguous": dcp.internal.run_contiguous}[entry]
    return run(GLA.configuration(CHUNK), GLA.inputs(*args), block_size=block_size)


# Every public argument that is a count or a size: (name, call with it, a valid value).
POSITIVE_INTS = {
    "GatedDeltaRule": ("chunk_size", lambda n: dcp.GatedDeltaRule(chunk_size=n), 4),
    "chunk_gated_delta_rule": (
        "chunk_size",
        lambda n: FAMILIES[0].chunk(*FAMILIES[0].make(0, **SHAPE)[0], chunk_size=n),
        4,
    ),
    "run": ("block_size", lambda n: _run_gla("run", n), 4),
    "run_contiguous": ("block_size", lambda n: _run_gla("run_contiguous", n), 4),
    "to_zigzag": ("cp", lambda n: dcp.to_zigzag(jnp.arange(16).reshape(2, 8), n), 2),
    "from_zigzag": ("cp", lambda n: dcp.from_zigzag(jnp.arange(16).reshape(2, 8), n), 2),
    "CausalSelfAttention-num_heads": (
        "num_heads",
        lambda n: CausalSelfAttention(16, n, 4, key=jr.key(0)),
        2,
    ),
    "CausalSelfAttention-num_kv_heads": (
        "num_kv_heads",
        lambda n: CausalSelfAttention(16, 2, 4, num_kv_heads=n, key=jr.key(0)),
        1,
    ),
    "CausalSelfAttention-tile_size": (
        "tile_size",
        lambda n: CausalSelfAttention(16, 2, 4, tile_size=n, key=jr.key(0)),
        4,
    ),
    "CausalConv1d": ("kernel_size", lambda n: CausalConv1d(4, n, key=jr.key(0)), 4),
    "GatedDeltaNet": (
        "chunk_size",
        lambda n: GatedDeltaNet(16, 1, 2, 4, 4, chunk_size=n, key=jr.key(0)),
        4,
    ),
    "GatedDeltaNet.prefill": (
        "checkpoint_every",
        lambda n: _layer().prefill(jnp.ones((8, 16)), checkpoint_every=n),
        4,
    ),
    "HybridLM": (
        "attention_every",
        lambda n: HybridLM(11, 16, 2, attention_every=n, chunk_size=4, key=jr.key(0)),
        2,
    ),
    "fla.chunk_gated_delta_product": ("num_householder", _delta_product_flat, 2),
}


@pytest.mark.parametrize("entry", list(POSITIVE_INTS))
def test_positive_int_arguments(entry, without_runtime_typecheck):
    # The same errors everywhere: a TypeError for what is not an integer (a float, even an
    # integral one, a bool, a string), a ValueError for an integer below 1; a NumPy
    # integer is the Python int it holds.
    name, call, valid = POSITIVE_INTS[entry]
    for bad in [0, -1]:
        with pytest.raises(ValueError, match=f"`{name}` must be a positive int; got {bad}"):
            call(bad)
    for bad in [2.0, True, "4"]:
        with pytest.raises(TypeError, match=f"`{name}` must be an int"):
            call(bad)
    assert eqx.tree_equal(call(np.int64(valid)), call(valid))


# ---------------------------------------------------------------------------------------
# Issue 50 item 7: the engine's and the sharding's unclear errors
# ---------------------------------------------------------------------------------------


def test_batch_not_divisible_by_batch_axis():
    # JAX alone says `IndivisibleError` from inside the placement.
    mesh = jax.make_mesh((2, 2), ("data", "cp"), devices=jax.devices()[:4])
    cp = dcp.ContextParallel("cp", mesh=mesh, batch_axis="data")
    args, _ = FAMILIES[0].make(0, **{**SHAPE, "b": 3})
    with pytest.raises(ValueError, match=r"batch size \(3\) must be divisible by 2 .*'data'"):
        FAMILIES[0].chunk(*args, chunk_size=CHUNK, cp=cp)


def test_batch_axis_is_the_context_axis():
    # JAX alone fails late, at the call, with `DuplicateSpecError`.
    with pytest.raises(ValueError, match="`batch_axis` .'cp'. is the context-parallel axis"):
        dcp.ContextParallel("cp", mesh=_mesh(), batch_axis="cp")


@pytest.mark.parametrize("kind", ["list", "array", "abstract"])
def test_mesh_must_be_a_mesh(kind, without_runtime_typecheck):
    devices = jax.devices()[:2]
    mesh = {
        "list": devices,
        "array": np.asarray(devices),
        "abstract": _mesh().abstract_mesh,
    }[kind]
    with pytest.raises(TypeError, match=r"`mesh` must be a jax.sharding.Mesh .*jax.make_mesh"):
        dcp.ContextParallel("cp", mesh=mesh)  # pyright: ignore[reportArgumentType]


def test_memory_as_a_numpy_string():
    # `np.str_("high")` passed the check, then failed inside `jit`.
    args, _ = FAMILIES[0].make(0, **SHAPE)
    high = FAMILIES[0].chunk(*args, chunk_size=CHUNK, memory="high")
    given = FAMILIES[0].chunk(*args, chunk_size=CHUNK, memory=np.str_("high"))
    assert eqx.tree_equal(high, given)
    high_np: Any = np.str_("high")
    layer = GatedDeltaNet(8, 1, 2, 4, 4, chunk_size=CHUNK, memory=high_np, key=jr.key(0))
    assert type(layer.memory) is str
    layer(jnp.ones((8, 8)))


@pytest.mark.parametrize(
    ("cu", "rule"),
    [([1, 8], "must start at 0"), ([0, 5, 3, 8], "must not decrease"), ([0, 5, 9], "must end")],
)
def test_cu_seqlens_error_names_the_problem_first(cu, rule, without_runtime_typecheck):
    # The first line of the error was equinox's "Above is the stack outside of JIT".
    family = FAMILIES[0]
    args, _ = family.make(0, **SHAPE)
    calls = [
        lambda cu: family.chunk(*args, chunk_size=CHUNK, cu_seqlens=cu),
        lambda cu: family.chunk(*args, chunk_size=CHUNK, cu_seqlens=cu, cp=_global_cp()),
        lambda cu: CausalConv1d(4, 3, key=jr.key(0))(jnp.ones((8, 4)), cu_seqlens=cu),
        lambda cu: GatedDeltaNet(8, 1, 2, 4, 4, chunk_size=CHUNK, key=jr.key(0))(
            jnp.ones((8, 8)), cu_seqlens=cu
        ),
        lambda cu: dcp.previous_tokens(jnp.ones((1, 8)), cu_seqlens=cu),
    ]
    for call in calls:
        for given in (cu, np.asarray(cu), jnp.asarray(cu)):
            with pytest.raises(ValueError) as info:
                call(given)
            assert str(info.value).startswith(f"`cu_seqlens` {rule}"), str(info.value)


def _global_cp() -> dcp.ContextParallel:
    return dcp.ContextParallel("cp", mesh=_mesh())

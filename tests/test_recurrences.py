"""Properties every recurrence must have, checked for each entry of the registry
(tests/registry.py) against its independent float64 token-by-token loop (tests/helpers.py).

A new recurrence gets every test here by adding one `Family` to the registry.

Compilation dominates the run time: each test compiles one small function, and the big
grids keep a covering subset in the default run (`pairwise`), the rest marked `slow`.
"""

import contextlib
import functools as ft
import os
import sys
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp

from . import _stall
from .helpers import (
    delta_product_reference,
    directional_check,
    elementwise_check,
    make_delta_product_inputs,
    pairwise,
    rel_err,
    value_and_grad_fn,
    weighted_loss,
)
from .registry import (
    exchange_id,
    EXCHANGE_NAMES,
    EXCHANGES,
    FAMILIES,
    Family,
    GATED_DELTA_RULE,
    KIMI_DELTA_ATTENTION,
)


CHUNK = 8
# 40 tokens: 5 chunks of 8; on 2, 4 and 8 ranks, 20, 10 and 5 tokens each (never whole
# chunks). One key head read by two value heads (r = 2), K != V.
SHAPE = dict(b=1, t=40, h=1, hv=2, dk=8, dv=6)


def _name(family: Family) -> str:
    return family.name


def _families(fast=lambda i, family: True):
    return [
        pytest.param(f, id=f.name, marks=() if fast(i, f) else (pytest.mark.slow,))
        for i, f in enumerate(FAMILIES)
    ]


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _mesh(cp: int):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _options(family: Family, *, l2norm=True, scale=None, chunk_size: int | None = CHUNK):
    """Keyword arguments shared by every entry point (`chunk_size` only for the chunked ones)."""
    kw: dict = dict(scale=scale)
    if family.l2norm:
        kw["use_qk_l2norm"] = l2norm
    return kw if chunk_size is None else {**kw, "chunk_size": chunk_size}


def _reference(family: Family, args, h0, **kw):
    """The float64 loop with the options of `_options(family)` (l2norm where it applies)."""
    return family.reference(*args, initial_state=h0, l2norm=family.l2norm, **kw)


@ft.cache
def _jit(fn, **kw):
    """`jax.jit` of `fn(*args, initial_state=h0, **kw)`, one per function and options."""
    return jax.jit(lambda args, h0: fn(*args, initial_state=h0, **kw))


@ft.cache
def _cp_jit(family: Family, cp: int, exchange, chunk_size: int = CHUNK):
    """`jax.jit` of `chunk_X_cp` inside `jax.shard_map` over a `cp`-device mesh: sequence
    sharded, initial and final states replicated."""
    seq, rep = P(None, "cp"), P()

    def per_rank(args, h0):
        return family.chunk(
            *args,
            initial_state=h0,
            **_options(family, chunk_size=chunk_size),
            cp=dcp.ContextParallel("cp", exchange=exchange),
        )

    specs = ((seq,) * len(family.arg_names), rep)
    return jax.jit(jax.shard_map(per_rank, mesh=_mesh(cp), in_specs=specs, out_specs=(seq, rep)))


def _cp_forward(family: Family, cp: int, exchange, chunk_size: int = CHUNK):
    """`_cp_jit` on global arrays, placing them on the mesh first."""
    mesh = _mesh(cp)
    fn = _cp_jit(family, cp, exchange, chunk_size)

    def call(args, h0):
        args = jax.device_put(args, NamedSharding(mesh, P(None, "cp")))
        return fn(args, jax.device_put(h0, NamedSharding(mesh, P())))

    return call


@ft.cache
def _grad_fn(
    family: Family,
    kind: str = "chunk",
    cp: int | None = None,
    exchange: Any = "allgather",
    layout: dcp.AbstractLayout = dcp.Contiguous(),
    **kw,
):
    """Value and gradient (w.r.t. every argument and the initial state) of a weighted sum of
    outputs and final state; one compilation per family and kind. `kw`: more options of
    the chunked form."""

    def fn(*a):
        if kind == "recurrent":
            return family.recurrent(
                *a[:-1], initial_state=a[-1], **_options(family, chunk_size=None)
            )
        if cp is None:
            return family.chunk(*a[:-1], initial_state=a[-1], **_options(family), **kw)
        return family.chunk(
            *a[:-1],
            initial_state=a[-1],
            **_options(family),
            **kw,
            cp=dcp.ContextParallel("cp", exchange=exchange, layout=layout),
        )

    zigzag = isinstance(layout, dcp.Zigzag)
    return value_and_grad_fn(fn, len(family.arg_names) + 1, cp=cp, zigzag=zigzag)


def _check_gradients(family: Family, args, h0, grads, tol=1e-4, elementwise=()):
    """Gradients vs central differences of the float64 loop: along a random direction for
    each argument, or element by element for the arguments named in `elementwise`."""
    arrays = [*args, h0]
    names = [*family.arg_names, "initial_state"]

    def loss(a):
        return weighted_loss(*_reference(family, a[:-1], a[-1]))

    errors = directional_check(grads, loss, arrays)
    for i, (name, err) in enumerate(zip(names, errors)):
        if name in elementwise:
            err = elementwise_check(grads[i], loss, arrays, i)
        assert err <= tol, (name, err)


# ---------------------------------------------------------------------------------------
# One device: the chunked and the recurrent forms against the loop
# ---------------------------------------------------------------------------------------

CHUNKED_CASES = [
    # t, chunk_size, b, h, hv, dk, dv, initial state, l2norm, scale
    (37, 16, 2, 1, 2, 8, 6, True, True, None),
    (1, 8, 1, 2, 2, 8, 6, False, False, 0.3),
    (45, 12, 1, 2, 4, 16, 7, True, False, None),  # a chunk size that is not a power of two
    (64, 16, 1, 1, 1, 8, 6, False, True, 0.3),  # whole chunks
    (65, 32, 2, 1, 3, 8, 6, True, False, None),  # r = 3
    (23, 5, 1, 1, 2, 8, 6, True, True, None),
    (200, 64, 1, 2, 4, 16, 8, True, True, None),
]


def _chunked_params():
    # Every family and every case in the default run (each family once); the rest `slow`.
    return pairwise(
        [FAMILIES, CHUNKED_CASES],
        ids=[_name, lambda c: "t{}-c{}-b{}-h{}-hv{}-k{}-v{}-h0{}-l2{}-s{}".format(*c)],
        cover=[],
    )


@pytest.mark.parametrize("family, case", _chunked_params())
def test_chunked_matches_loop(family, case):
    t, chunk_size, b, h, hv, dk, dv, use_state, l2norm, scale = case
    args, h0 = family.make(10, b=b, t=t, h=h, hv=hv, dk=dk, dv=dv)
    h0 = h0 if use_state else None
    kw = _options(family, l2norm=l2norm, scale=scale, chunk_size=chunk_size)
    o, final = _jit(family.chunk, **kw)(args, h0)
    expected_o, expected_h = family.reference(
        *args, initial_state=h0, scale=scale, l2norm=kw.get("use_qk_l2norm", False)
    )
    assert o.shape == (b, t, hv, dv) and o.dtype == args[2].dtype
    assert final.shape == (b, hv, family.state_rows * dk, dv) and final.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
@pytest.mark.parametrize(
    "t, b, h, hv, use_state, l2norm, scale",
    [(21, 1, 1, 2, True, True, None)]
    + [pytest.param(33, 2, 2, 4, False, False, 0.3, marks=pytest.mark.slow)],
)
def test_recurrent_matches_loop(family, t, b, h, hv, use_state, l2norm, scale):
    args, h0 = family.make(11, b=b, t=t, h=h, hv=hv, dk=8, dv=6)
    h0 = h0 if use_state else None
    kw = _options(family, l2norm=l2norm, scale=scale, chunk_size=None)
    o, final = _jit(family.recurrent, **kw)(args, h0)
    expected_o, expected_h = family.reference(
        *args, initial_state=h0, scale=scale, l2norm=kw.get("use_qk_l2norm", False)
    )
    assert o.shape == expected_o.shape and o.dtype == args[2].dtype
    assert final.shape == (b, hv, family.state_rows * 8, 6) and final.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


@pytest.mark.parametrize(
    "family", _families(lambda i, f: f.name in ("kimi_delta_attention", "gla"))
)
def test_engine_run_matches_loop(family):
    # The generic entry point with the configuration and the inputs PyTree, as a user's
    # own recurrence would be run.
    args, h0 = family.make(12, **SHAPE)
    recurrence = family.configuration(CHUNK)
    run = eqx.filter_jit(dcp.run)
    o, final = run(recurrence, family.inputs(*args), initial_state=h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


# ---------------------------------------------------------------------------------------
# Dtypes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family, mix", pairwise([FAMILIES, ["all_bf16", "qk_bf16"]], ids=[_name, str], cover=[])
)
def test_output_dtype_is_v_dtype(family, mix):
    args, h0 = family.make(13, **SHAPE)
    if mix == "all_bf16":
        args = tuple(x.astype(jnp.bfloat16) for x in args)
    else:  # low-precision queries and keys, float32 values: the output follows v (the
        # policy from the inputs would be "bfloat16"; exact products are asked for here)
        args = (args[0].astype(jnp.bfloat16), args[1].astype(jnp.bfloat16), *args[2:])
    precision = None if mix == "all_bf16" else "highest"
    o, final = _jit(family.chunk, precision=precision, **_options(family))(args, h0)
    assert o.dtype == args[2].dtype and final.dtype == jnp.float32
    expected_o, expected_h = _reference(family, args, h0)  # on the rounded inputs
    assert np.all(np.isfinite(np.asarray(o, np.float32)))
    tol = 2e-2 if mix == "all_bf16" else 1e-5
    assert rel_err(o, expected_o) <= tol
    assert rel_err(final, expected_h) <= tol


@pytest.mark.parametrize("family", _families(lambda i, f: i in (0, 2)))
def test_float64_inputs_stay_float64(family):
    with jax.enable_x64(True):
        args, h0 = family.make(14, **SHAPE, dtype=jnp.float64)
        h0 = h0.astype(jnp.float64)
        fn = jax.jit(lambda args, h0: family.chunk(*args, initial_state=h0, **_options(family)))
        o, final = fn(args, h0)
        assert o.dtype == jnp.float64 and final.dtype == jnp.float64
        expected_o, expected_h = _reference(family, args, h0)
        assert rel_err(o, expected_o) <= 1e-12
        assert rel_err(final, expected_h) <= 1e-12


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
@pytest.mark.parametrize("kind", ["chunk", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_gradients_match_loop(family, kind):
    args, h0 = family.make(15, **SHAPE)
    o, final, grads = _grad_fn(family, kind)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


@pytest.mark.parametrize(
    "family", _families(lambda i, f: f.name not in ("delta_rule", "gla_per_head"))
)
def test_extreme_gates(family):
    # Decays that underflow float32 inside a chunk (exp(-1e4) = 0), runs without decay,
    # channels that disagree, beta at 0 and 1: everything exact and finite.
    args, h0 = family.make(16, **SHAPE)
    args = list(args)
    gi = family.gate_index()
    if gi is not None:
        g = np.array(args[gi])
        if family.gate_per_channel:
            g[:, 3:12, :, :4] = -1e4  # half the channels forget completely
            g[:, 12:30] = 0.0  # then nothing decays for a while
            g[:, 20, :, 6] = -1e4
            g[:, 31:40, :, 4:] = -30.0
        else:
            g[:, 5:12] = -1e4  # a run of full forgetting
            g[:, 12:30] = 0.0  # a run of no decay
            g[:, 31] = -1e4
        args[gi] = jnp.asarray(g)
    for name in family.unit_gates:
        bi = family.arg_names.index(name)
        beta = np.array(args[bi])
        beta[:, 30:35] = 0.0
        beta[:, 35:40] = 1.0
        args[bi] = jnp.asarray(beta)
    o, final, grads = _grad_fn(family)(*args, h0)  # the shapes of test_gradients_match_loop
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    for grad in grads:
        assert np.all(np.isfinite(grad))
    # Element by element for the arguments changed here: a projection on one random
    # direction can cancel to a small number, leaving float32 rounding of the other
    # elements as a large relative error of the sum (seen for beta of the gated delta
    # product: 3e-4 along the direction, 1.4e-7 element by element).
    _check_gradients(family, args, h0, grads, elementwise=(family.gate, *family.unit_gates))


# ---------------------------------------------------------------------------------------
# Context parallelism
# ---------------------------------------------------------------------------------------


_CP_FAST = {
    ("gated_delta_rule", "AllGather()", 8),
    ("delta_rule", "PPermute()", 4),
    ("kimi_delta_attention", "Ring()", 2),
    ("gla", "Auto()", 8),
    ("gla_per_head", "AllGather()", 4),
    ("gated_delta_product", "PPermute()", 2),
    ("gdn2", "Ring()", 8),
    ("dplr", "Auto()", 2),
}


@pytest.mark.parametrize(
    "family, exchange, cp",
    pairwise(
        [FAMILIES, EXCHANGES, [2, 4, 8]],
        ids=[_name, exchange_id, lambda cp: f"cp{cp}"],
        # Each family once, every exchange and cp; with test_cp_gradients_match_loop's
        # cases, every exchange at every cp. The slow run adds a cover of every pair.
        fast=lambda f, ex, cp: (f.name, exchange_id(ex), cp) in _CP_FAST,
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    ),
)
def test_cp_matches_one_device(family, exchange, cp):
    args, h0 = family.make(17, **{**SHAPE, "b": 2})
    o, final = _cp_forward(family, cp, exchange)(args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert o.shape == expected_o.shape and o.dtype == args[2].dtype
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    single_o, single_h = _jit(family.chunk, **_options(family))(args, h0)
    assert rel_err(o, single_o) <= 1e-5
    assert rel_err(final, single_h) <= 1e-5


@pytest.mark.parametrize("name", EXCHANGE_NAMES)
def test_exchange_shorthands(name):
    # The string names the exchange module of the same name: the same program (lowered,
    # not compiled).
    family = FAMILIES[EXCHANGE_NAMES.index(name)]
    module = EXCHANGES[EXCHANGE_NAMES.index(name)]
    args, h0 = family.make(18, **SHAPE)
    mesh = _mesh(4)
    args = jax.device_put(args, NamedSharding(mesh, P(None, "cp")))
    h0 = jax.device_put(h0, NamedSharding(mesh, P()))
    by_name = _cp_jit(family, 4, name).lower(args, h0).as_text()
    by_module = _cp_jit(family, 4, module).lower(args, h0).as_text()
    assert by_name == by_module


def _cp_grad_params():
    # One cp per family and exchange. In the default run four families, every exchange and
    # cp once: with test_cp_matches_one_device's cases, every exchange at every cp.
    cps = (2, 4, 8)
    return [
        pytest.param(
            f,
            ex,
            cps[(i + j) % 3],
            id=f"{f.name}-{exchange_id(ex)}-cp{cps[(i + j) % 3]}",
            marks=() if j == i % len(EXCHANGES) and i in (0, 1, 2, 7) else (pytest.mark.slow,),
        )
        for i, f in enumerate(FAMILIES)
        for j, ex in enumerate(EXCHANGES)
    ]


@pytest.mark.parametrize("family, exchange, cp", _cp_grad_params())
def test_cp_gradients_match_loop(family, exchange, cp):
    args, h0 = family.make(19, **SHAPE)
    o, final, grads = _grad_fn(family, "chunk", cp, exchange)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


def _memory_params():
    # memory="high": the backward reads every chunk's factors, prepare's VJP and state from
    # the forward instead of forming them again. In the default run the gated delta rule on
    # one device and GLA at cp = 2 zigzag (two compilations, ~6 s); the slow run adds every
    # family on one device and at cp = 4 zigzag (the exchange rotating).
    params = []
    for i, f in enumerate(FAMILIES):
        for cp in (None, 2 if f.name == "gla" else 4):
            fast = (f.name, cp) in {("gated_delta_rule", None), ("gla", 2)}
            params.append(
                pytest.param(
                    f,
                    cp,
                    EXCHANGES[i % len(EXCHANGES)],
                    id=f"{f.name}-{'one_device' if cp is None else f'zigzag{cp}'}",
                    marks=() if fast else (pytest.mark.slow,),
                )
            )
    return params


@pytest.mark.parametrize("family, cp, exchange", _memory_params())
def test_memory_high_matches_loop(family, cp, exchange):
    args, h0 = family.make(23, **ZIGZAG_SHAPE)
    fn = _grad_fn(family, "chunk", cp, exchange, dcp.Zigzag(), memory="high")
    o, final, grads = fn(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


@ft.cache
def _blocks_grad_fn(family: Family, cp: int | None, memory: dcp.Memory, block_size: int):
    """`_grad_fn`'s value and gradient through `dcp.run` with `block_size` and `memory`."""

    def fn(*a):
        parallel = None if cp is None else dcp.ContextParallel("cp", layout=dcp.Zigzag())
        inputs = family.inputs(*a[:-1])
        rule = family.configuration(CHUNK)
        return dcp.run(
            rule, inputs, initial_state=a[-1], cp=parallel, memory=memory, block_size=block_size
        )

    return value_and_grad_fn(fn, len(family.arg_names) + 1, cp=cp, zigzag=cp is not None)


def _memory_blocks_params():
    # Every family on one device, GDN and GLA also at zigzag 2; in the default run GDN on
    # one device and GLA at zigzag 2 (~3 s each).
    params = [
        pytest.param(f, None, id=f"{f.name}-one_device", marks=() if i == 0 else pytest.mark.slow)
        for i, f in enumerate(FAMILIES)
    ]
    for f in FAMILIES:
        if f.name in ("gated_delta_rule", "gla"):
            slow = () if f.name == "gla" else pytest.mark.slow
            params.append(pytest.param(f, 2, id=f"{f.name}-zigzag2", marks=slow))
    return params


@pytest.mark.parametrize("family, cp", _memory_blocks_params())
def test_memory_high_in_blocks_matches_loop(family, cp):
    # memory="high" with several blocks: the kept factors, prepare's VJPs and chunk states
    # are stacked over the blocks and read back block by block (one device: 6 chunks in 3
    # blocks; zigzag on 2 ranks: 2 walks of 3 chunks, one chunk of each a block).
    args, h0 = family.make(24, **ZIGZAG_SHAPE)
    o, final, grads = _blocks_grad_fn(family, cp, "high", 2 * CHUNK)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


def test_memory_must_be_low_or_high(without_runtime_typecheck):
    args, h0 = GATED_DELTA_RULE.make(0, **SHAPE)
    with pytest.raises(ValueError, match='`memory` must be "low"'):
        dcp.chunk_gated_delta_rule(*args, memory="medium")  # pyright: ignore[reportArgumentType]


# ---------------------------------------------------------------------------------------
# The zigzag layout: rank r holds pieces r and 2cp-1-r of 2cp
# ---------------------------------------------------------------------------------------

# 48 tokens: on 2, 4 and 8 ranks, pieces of 12, 6 and 3 tokens (never whole chunks of 8).
ZIGZAG_SHAPE = dict(b=1, t=48, h=1, hv=2, dk=8, dv=6)


@ft.cache
def _zigzag_grad_fn(family: Family, cp: int, exchange, chunk_size: int = CHUNK):
    """Value and gradient of `chunk_X(..., cp=ContextParallel(layout=Zigzag()))` on arrays
    in sequence order (put in zigzag order on the way in, and back on the way out)."""

    def fn(*a):
        return family.chunk(
            *a[:-1],
            initial_state=a[-1],
            **_options(family, chunk_size=chunk_size),
            cp=dcp.ContextParallel("cp", exchange=exchange, layout=dcp.Zigzag()),
        )

    return value_and_grad_fn(fn, len(family.arg_names) + 1, cp=cp, zigzag=True)


# Every exchange and every cp in the default run, with six of the families; the slow run
# adds a cover of every pair (family and exchange, family and cp, exchange and cp).
_ZIGZAG_FAST = {
    ("gated_delta_rule", "AllGather()", 2),
    ("kimi_delta_attention", "Ring()", 8),
    ("gated_delta_product", "PPermute()", 4),
    ("gla", "Auto()", 4),
    ("gdn2", "AllGather()", 4),
    ("dplr", "PPermute()", 8),
}


@pytest.mark.parametrize(
    "family, exchange, cp",
    pairwise(
        [FAMILIES, EXCHANGES, [2, 4, 8]],
        ids=[_name, exchange_id, lambda cp: f"cp{cp}"],
        fast=lambda f, ex, cp: (f.name, exchange_id(ex), cp) in _ZIGZAG_FAST,
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    ),
)
def test_zigzag_matches_loop(family, exchange, cp):
    # Forward, final state and gradients w.r.t. every input and the initial state.
    args, h0 = family.make(31, **ZIGZAG_SHAPE)
    o, final, grads = _zigzag_grad_fn(family, cp, exchange)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert o.shape == expected_o.shape and o.dtype == args[2].dtype
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


# On 4 ranks, 8 pieces of 8 tokens; on 8 ranks, 16 pieces of 4 (the chunk size): documents
# crossing piece boundaries, rank boundaries and the middle of the sequence (where the chain
# turns back), one ending at the middle, empty ones at a piece boundary and at the end.
ZIGZAG_DOCS = [[0, 5, 5, 40, 41, 64], [0, 16, 16, 32, 61, 64, 64]]


def _zigzag_packed_params():
    # One fast case (8 ranks: pieces of one chunk); the slow run adds a cover of every pair
    # (family and cp, family and documents, cp and documents). The exchange rotates with
    # the family.
    fast = {(3, 8, 1)}
    params = pairwise(
        [FAMILIES, [2, 4, 8], list(range(len(ZIGZAG_DOCS)))],
        ids=[_name, lambda cp: f"cp{cp}", lambda k: f"docs{k}"],
        fast=lambda f, cp, k: (FAMILIES.index(f), cp, k) in fast,
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    )
    return [
        pytest.param(
            f,
            cp,
            ex,
            ZIGZAG_DOCS[k],
            id=f"{f.name}-cp{cp}-{exchange_id(ex)}-docs{k}",
            marks=p.marks,
        )
        for p in params
        for f, cp, k in [p.values]
        for ex in [EXCHANGES[FAMILIES.index(f) % 3]]
    ]


@pytest.mark.parametrize("family, cp, exchange, cu", _zigzag_packed_params())
def test_zigzag_packed_documents(family, cp, exchange, cu):
    # Packed documents on zigzag shards: outputs, per-document final states from
    # per-document initial states, and their gradients.
    args, _ = family.make(27, **PACKED)
    h0 = _doc_states(28, cu, family)

    def fn(*a):
        return family.chunk(
            *a[:-1],
            cu_seqlens=cu,
            initial_state=a[-1],
            **_options(family, chunk_size=4),
            cp=dcp.ContextParallel("cp", exchange=exchange, layout=dcp.Zigzag()),
        )

    o, finals, grads = value_and_grad_fn(fn, len(args) + 1, cp=cp, zigzag=True)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0, cu_seqlens=cu)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5
    names = [*family.arg_names, "initial_state"]

    def loss(a):
        return weighted_loss(*_reference(family, a[:-1], a[-1], cu_seqlens=cu))

    for name, err in zip(names, directional_check(grads, loss, [*args, h0])):
        assert err <= 1e-4, (name, err)


@pytest.mark.parametrize(
    "family", _families(lambda i, f: f.name in ("kimi_delta_attention", "gla_per_head"))
)
def test_zigzag_sharded_matches_loop(family):
    # `_sharded` takes and returns arrays in sequence order; with a data-parallel axis too.
    mesh = jax.make_mesh((2, 4), ("data", "cp"))
    args, h0 = family.make(32, **{**ZIGZAG_SHAPE, "b": 2})
    o, final = family.chunk(
        *args,
        initial_state=h0,
        **_options(family),
        cp=dcp.ContextParallel("cp", mesh=mesh, batch_axis="data", layout=dcp.Zigzag()),
    )
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


# ---------------------------------------------------------------------------------------
# `_sharded`: global arrays in and out
# ---------------------------------------------------------------------------------------


# In the default run, the families whose `_sharded` no other default test calls (the gated
# delta rule, GLA and DeltaProduct go through it in the compile-once and packed tests).
_SHARDED_FAST = {
    ("delta_rule", "cp4"),
    ("kimi_delta_attention", "data2xcp4"),
    ("gla_per_head", "cp4"),
}


@pytest.mark.parametrize(
    "family, mesh_kind",
    [
        pytest.param(f, kind, marks=() if (f.name, kind) in _SHARDED_FAST else (pytest.mark.slow,))
        for f in FAMILIES
        for kind in ["cp4", "data2xcp4"]
    ],
    ids=lambda x: x.name if isinstance(x, Family) else x,
)
def test_sharded_matches_loop(family, mesh_kind):
    if mesh_kind == "cp4":
        mesh, batch = _mesh(4), None
        args, h0 = family.make(20, **SHAPE)
    else:  # batch over "data", sequence over "cp"
        mesh, batch = jax.make_mesh((2, 4), ("data", "cp")), "data"
        args, h0 = family.make(20, **{**SHAPE, "b": 2})
    exchange = EXCHANGES[FAMILIES.index(family) % len(EXCHANGES)]
    cp = dcp.ContextParallel("cp", mesh=mesh, exchange=exchange, batch_axis=batch)
    o, final = family.chunk(*args, initial_state=h0, cp=cp, **_options(family))
    expected_o, expected_h = _reference(family, args, h0)
    assert o.shape == expected_o.shape and o.dtype == args[2].dtype
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


# jax records these for every top-level trace of a jitted function (a tracing-cache miss)
# and for every XLA compilation; a call that hits both caches records neither. Listening
# for them counts re-tracing and re-compilation without reaching into the library.
_TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def _count_compilations():
    events: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event in (_TRACE_EVENT, _COMPILE_EVENT):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("family", _families(lambda i, f: f.name in ("gated_delta_rule", "gla")))
def test_sharded_compiles_once(family):
    # Eager calls, as in a notebook: a second call with new values of the same shapes on an
    # equal mesh neither traces nor compiles again.
    def call(seed):
        args, h0 = family.make(seed, **SHAPE)
        out = family.chunk(
            *args, initial_state=h0, **_options(family), cp=dcp.ContextParallel("cp", mesh=_mesh(2))
        )
        return jax.block_until_ready(out), args, h0

    with _count_compilations() as control:  # the listener does hear a fresh jit
        jax.jit(lambda x: x * 2.0)(jnp.ones(3))
    assert _TRACE_EVENT in control and _COMPILE_EVENT in control
    call(21)
    args, h0 = family.make(22, **SHAPE)  # (generating inputs compiles nothing either)
    with _count_compilations() as events:
        (o, final), _, _ = call(22)
    assert events == [], f"the second call traced/compiled again: {events}"
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


# ---------------------------------------------------------------------------------------
# Packed documents (`cu_seqlens`)
# ---------------------------------------------------------------------------------------

PACKED = dict(b=1, t=64, h=1, hv=2, dk=8, dv=4)
DOCS = [
    [0, 5, 5, 40, 41, 64],  # an empty document, one-token documents
    [0, 17, 30, 64, 64],  # an empty document at the end
]
# On 4 ranks of 16 tokens: documents crossing one and two rank boundaries, a document
# ending exactly at a boundary, an empty document at a boundary.
CP_DOCS = [[0, 5, 5, 40, 41, 64], [0, 16, 16, 33, 64]]


def _doc_states(seed, cu, family: Family):
    rng = np.random.default_rng(seed)
    shape = (len(cu) - 1, PACKED["hv"], family.state_rows * PACKED["dk"], PACKED["dv"])
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _packed_params():
    # Four families in the default run, every form of cu_seqlens with every documents; the
    # slow run adds a cover of every pair (family and form, family and documents, form and
    # documents).
    return pairwise(
        [FAMILIES, ["list", "array"], DOCS],
        ids=[_name, str, lambda cu: f"docs{DOCS.index(cu)}"],
        fast=lambda f, form, cu: (
            FAMILIES.index(f) in (0, 3, 5, 6)
            and ["list", "array"].index(form) == FAMILIES.index(f) % 2
            and DOCS.index(cu) == (FAMILIES.index(f) // 2) % 2
        ),
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    )


@pytest.mark.parametrize("family, form, cu", _packed_params())
def test_packed_one_device(family, form, cu):
    args, _ = family.make(23, **PACKED)
    h0 = _doc_states(24, cu, family)
    kw = dict(initial_state=h0, **_options(family))
    if form == "list":
        o, finals = jax.jit(lambda args: family.chunk(*args, cu_seqlens=cu, **kw))(args)
    else:
        fn = jax.jit(lambda cu, args: family.chunk(*args, cu_seqlens=cu, **kw))
        o, finals = fn(jnp.asarray(cu, jnp.int32), args)
    expected_o, expected_h = _reference(family, args, h0, cu_seqlens=cu)
    assert o.shape == expected_o.shape and o.dtype == args[2].dtype
    assert finals.shape == (
        len(cu) - 1,
        PACKED["hv"],
        family.state_rows * PACKED["dk"],
        PACKED["dv"],
    )
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5
    # Without initial states (zeros): still one final state per document; traced only.
    _, shape = jax.eval_shape(
        lambda args: family.chunk(*args, cu_seqlens=cu, **_options(family)), args
    )
    assert shape.shape == finals.shape


def _packed_cp_params():
    # The slow run adds a cover of every pair (family and cp, family and documents, cp and
    # documents).
    return pairwise(
        [FAMILIES, [4, 8], CP_DOCS],
        ids=[_name, lambda cp: f"cp{cp}", lambda cu: f"docs{CP_DOCS.index(cu)}"],
        # Five families in the default run: every exchange, both forms of cu_seqlens.
        fast=lambda f, cp, cu: (
            cp == 4
            and CP_DOCS.index(cu) == FAMILIES.index(f) % 2
            and f.name
            in ("gated_delta_rule", "kimi_delta_attention", "gla", "gated_delta_product", "dplr")
        ),
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    )


@pytest.mark.parametrize("family, cp, cu", _packed_cp_params())
def test_packed_cp_documents_cross_ranks(family, cp, cu):
    # Even families: cu_seqlens an int array and per-document initial states; odd ones: a
    # Python list and zero initial states. The exchange rotates with the family.
    i = FAMILIES.index(family)
    exchange = EXCHANGES[i % len(EXCHANGES)]
    args, _ = family.make(25, **PACKED)
    extra = (
        {"cu": jnp.asarray(cu, jnp.int32), "h0": _doc_states(26, cu, family)} if i % 2 == 0 else {}
    )
    mesh = _mesh(cp)
    seq = P(None, "cp")

    def per_rank(extra, args):
        return family.chunk(
            *args,
            cu_seqlens=extra.get("cu", cu),
            initial_state=extra.get("h0"),
            **_options(family, chunk_size=4),
            cp=dcp.ContextParallel("cp", exchange=exchange),
        )

    specs = ({k: P() for k in extra}, (seq,) * len(args))
    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=(seq, P())))
    o, finals = fn(
        jax.device_put(extra, NamedSharding(mesh, P())),
        jax.device_put(args, NamedSharding(mesh, seq)),
    )
    expected_o, expected_h = _reference(family, args, extra.get("h0"), cu_seqlens=cu)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5


@pytest.mark.parametrize(
    "family", _families(lambda i, f: f.name in ("gated_delta_rule", "gated_delta_product"))
)
def test_packed_sharded_with_document_states(family):
    # `_sharded` with cu_seqlens and one initial state per document, documents crossing
    # rank boundaries.
    cu = CP_DOCS[0]
    args, _ = family.make(27, **PACKED)
    h0 = _doc_states(28, cu, family)
    o, finals = family.chunk(
        *args,
        cu_seqlens=jnp.asarray(cu, jnp.int32),
        initial_state=h0,
        **_options(family, chunk_size=4),
        cp=dcp.ContextParallel("cp", mesh=_mesh(4)),
    )
    expected_o, expected_h = _reference(family, args, h0, cu_seqlens=cu)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5


# ---------------------------------------------------------------------------------------
# The compose law of the configuration's interface
# ---------------------------------------------------------------------------------------


@eqx.filter_jit
def _compose_checks(recurrence, chunks, h0):
    factors = recurrence.prepare(chunks)
    n = jax.tree.leaves(factors)[0].shape[0]
    f = [jax.tree.map(lambda x: x[i], factors) for i in range(n)]
    maps = [recurrence.chunk_map(fi) for fi in f]
    composed, then = [], []
    running = maps[0]
    for i in range(1, n):
        composed.append(recurrence.compose(f[i], running))
        then.append(running.then(maps[i]))
        running = composed[-1]
    mapped, stepped, h = [], [], h0
    for i in range(n):
        mapped.append(maps[i](h))
        h, _ = recurrence.step(f[i], h)
        stepped.append(h)
    return composed, then, mapped, stepped, running(h0)


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
def test_compose_law(family):
    # For chunked factors f_c: compose(f_c, running) == running.then(chunk_map(f_c)), and
    # chunk_map(f_c)(h) == step(f_c, h)[0]; folding the chunks gives the final state.
    c, n = 8, 4
    args, h0 = family.make(29, **{**SHAPE, "b": 2, "t": c * n})
    recurrence = family.configuration(c)
    inputs = family.inputs(*args)
    state = recurrence.state(inputs)
    assert state.shape == h0.shape and state.dtype == jnp.float32
    # The engine's layout: time (axis 1) split as (B, N, C, ...).
    chunks = jax.tree.map(lambda x: x.reshape(x.shape[0], n, c, *x.shape[2:]), inputs)
    composed, then, mapped, stepped, total = _compose_checks(recurrence, chunks, h0)
    for a, b in zip(composed, then):
        assert type(a) is type(b)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert x.shape == y.shape and rel_err(x, y) <= 1e-5
    for a, b in zip(mapped, stepped):
        assert rel_err(a, b) <= 1e-5
    _, expected_h = _reference(family, args, h0)
    assert rel_err(stepped[-1], expected_h) <= 1e-5
    assert rel_err(total, expected_h) <= 1e-5


# ---------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
def test_bad_input(family, without_runtime_typecheck):
    args, h0 = family.make(0, b=1, t=10, h=1, hv=2, dk=8, dv=6)
    q, k, v, *rest = args
    for fn in [ft.partial(family.chunk, chunk_size=4), family.recurrent]:
        with pytest.raises(ValueError, match="sequence length|must have shape"):
            fn(q, k, v[:, :9], *rest)
        with pytest.raises(ValueError, match="`q`"):
            fn(q[0], k, v, *rest)
        with pytest.raises(ValueError, match="floating"):
            fn(q, k, v.astype(jnp.int32), *rest)
        with pytest.raises(ValueError, match="initial_state"):
            fn(*args, initial_state=h0[..., :-1])
        with pytest.raises(ValueError, match="multiple of the number of key heads"):
            fn(*family.make(0, b=1, t=10, h=2, hv=3, dk=8, dv=6)[0])
        gi = family.gate_index()
        if gi is not None:
            bad = list(args)
            bad[gi] = args[gi][..., None]
            with pytest.raises(ValueError, match=f"`{family.gate}`"):
                fn(*bad)
    for chunk_size in [0, -8, True]:  # a bool is a TypeError, the others ValueErrors
        with pytest.raises((TypeError, ValueError), match="chunk_size"):
            family.chunk(*args, chunk_size=chunk_size)


@pytest.mark.parametrize("family", FAMILIES, ids=_name)
def test_runtime_typecheck_also_rejects(family):
    args, _ = family.make(0, b=1, t=10, h=1, hv=2, dk=8, dv=6)
    q, k, v, *rest = args
    with pytest.raises(Exception):
        family.chunk(q, k, v[:, :9], *rest)


@pytest.mark.parametrize("family", [GATED_DELTA_RULE, KIMI_DELTA_ATTENTION], ids=_name)
def test_bad_cu_seqlens(family, without_runtime_typecheck):
    args, _ = family.make(0, **PACKED)

    def call(cu, args=args, h0=None):
        return family.chunk(*args, initial_state=h0, cu_seqlens=cu, chunk_size=8)

    # Bad values are checked with `eqx.error_if` (so under `jit` too): eagerly, that raises
    # `EquinoxRuntimeError`, a RuntimeError.
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        call(jnp.asarray([0, 10, 60], jnp.int32))  # not ending at T
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        call([0, 30, 20, 64])  # decreasing
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        call(jnp.asarray([1, 30, 64], jnp.int32))  # not starting at 0
    with pytest.raises(ValueError, match="cu_seqlens"):
        call(jnp.asarray([0.0, 64.0]))  # not integers
    with pytest.raises(ValueError, match="batch"):
        call([0, 64], args=tuple(jnp.concatenate([x, x]) for x in args))
    with pytest.raises(ValueError, match="document"):
        call([0, 64], h0=jnp.zeros((3, PACKED["hv"], PACKED["dk"], PACKED["dv"])))


BAD_CU = [
    pytest.param([1, 30, 64], id="not_from_0"),
    pytest.param([0, 30, 20, 64], id="decreasing"),
    pytest.param([0, 10, 60], id="not_to_T"),
]


@pytest.mark.parametrize("cu", BAD_CU)
def test_invalid_cu_seqlens_under_jit(cu):
    # Traced offsets can't be checked when tracing: the check runs with the computation
    # (`eqx.error_if`) and fails it, instead of silently giving garbage.
    family = GATED_DELTA_RULE
    args, _ = family.make(0, **PACKED)
    fn = jax.jit(lambda cu, args: family.chunk(*args, cu_seqlens=cu, chunk_size=8))
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        jax.block_until_ready(fn(jnp.asarray(cu, jnp.int32), args))


_INVALID_UNDER_CP = """
import sys
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import deltanet_cp as dcp

rng = np.random.default_rng(0)
t, dk, dv = 64, 8, 4
args = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in
             [(1, t, 1, dk), (1, t, 1, dk), (1, t, 2, dv), (1, t, 2, dk), (1, t, 2)])
mesh = jax.make_mesh((4,), ("cp",))
seq = P(None, "cp")

def per_rank(cu, args):
    return dcp.chunk_kda(
        *args, cu_seqlens=cu, chunk_size=4, cp=dcp.ContextParallel("cp")
    )[0]

fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), (seq,) * 5), out_specs=seq))
cu = jnp.asarray([int(c) for c in sys.argv[1].split(",")], jnp.int32)
try:
    jax.block_until_ready(fn(jax.device_put(cu, NamedSharding(mesh, P())),
                             jax.device_put(args, NamedSharding(mesh, seq))))
except (ValueError, RuntimeError) as e:
    print("RAISED", type(e).__name__, "cu_seqlens" in str(e))
else:
    print("NO ERROR")
"""


@pytest.mark.parametrize(
    "cu",
    [
        p if p.id == "decreasing" else pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
        for p in BAD_CU
    ],
)
def test_invalid_cu_seqlens_under_cp(cu):
    # In a fresh process: once an `eqx.error_if` has fired inside `shard_map`, every later
    # `jax.effects_barrier()` of the process raises again (JAX's runtime tokens stay failed),
    # which would leak into the other tests.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env = {
        **os.environ,
        "XLA_FLAGS": " ".join([*flags, "--xla_force_host_platform_device_count=4"]),
    }
    result = _stall.run([sys.executable, "-c", _INVALID_UNDER_CP, ",".join(map(str, cu))], env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    kind, names_cu_seqlens = result.stdout.split()[-2:]
    assert result.stdout.split()[-3] == "RAISED", result.stdout + result.stderr[-3000:]
    assert kind in ("JaxRuntimeError", "EquinoxRuntimeError", "ValueError"), kind
    assert names_cu_seqlens == "True", result.stdout


# ---------------------------------------------------------------------------------------
# Family-specific
# ---------------------------------------------------------------------------------------


def test_gated_delta_product_ungated_three_steps():
    # DeltaProduct without a gate, n_h = 3, no l2norm, no state, another scale and chunk.
    args, _ = make_delta_product_inputs(30, **SHAPE, n=3, gated=False)
    o, final = jax.jit(ft.partial(dcp.chunk_gated_delta_product, scale=0.3, chunk_size=16))(*args)
    expected_o, expected_h = delta_product_reference(*args, scale=0.3)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5


def test_gated_delta_product_bad_input(without_runtime_typecheck):
    q, k, v, g, beta = make_delta_product_inputs(0, b=1, t=10, h=1, hv=2, dk=8, dv=6)[0]
    fn = dcp.chunk_gated_delta_product
    with pytest.raises(ValueError, match="`k` must have rank 5"):
        fn(q, k[:, :, 0], v, g, beta)
    with pytest.raises(ValueError, match="householder"):
        fn(q, k, v[:, :, :1], g, beta)
    with pytest.raises(ValueError, match="`beta` must have shape"):
        fn(q, k, v, g, beta[:, :, :1])


# ---------------------------------------------------------------------------------------
# Blocks of chunks: the factors are formed per block, the state recursion walks every chunk
# ---------------------------------------------------------------------------------------

# Block sizes in tokens at chunk 8: one block for the whole sequence, one chunk per block,
# and blocks of three chunks (5 chunks -> 2 blocks of 3, one padding chunk; 8 packed chunks
# -> 3 blocks of 3). The rest of the suite runs with blocks of two chunks (tests/conftest.py).
BLOCKS = [4096, CHUNK, 3 * CHUNK]


@pytest.mark.parametrize(
    "family, block_size",
    pairwise(
        [FAMILIES, BLOCKS],
        ids=[_name, str],
        # Every block size in the default run, each with another kind of map (dense,
        # diagonal, diagonal plus low rank); the rest `slow`.
        fast=lambda f, bs: (
            (f.name, bs) in {("gated_delta_rule", 3 * CHUNK), ("gla", CHUNK), ("dplr", 4096)}
        ),
    ),
)
def test_blocks_match_loop(family, block_size):
    # One device: outputs, final state and every gradient; packed documents with their
    # initial and final states; context parallelism (cp=2) with its gradients.
    recurrence = family.configuration(CHUNK)
    args, h0 = family.make(41, **SHAPE)

    def fn(*a):
        inputs = family.inputs(*a[:-1])
        return dcp.run(recurrence, inputs, initial_state=a[-1], block_size=block_size)

    o, final, grads = value_and_grad_fn(fn, len(family.arg_names) + 1)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)

    cu = DOCS[0]
    args, _ = family.make(42, **PACKED)
    docs = _doc_states(43, cu, family)
    documents = {"cu_seqlens": cu} if family.inputs_run_a_recurrence else {}
    run = jax.jit(
        lambda args, docs: dcp.run(
            recurrence,
            family.inputs(*args, **documents),
            initial_state=docs,
            cu_seqlens=cu,
            block_size=block_size,
        )
    )
    o, finals = run(args, docs)
    expected_o, expected_h = _reference(family, args, docs, cu_seqlens=cu)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5

    args, h0 = family.make(44, **SHAPE)

    cp = dcp.ContextParallel("cp")
    sharded = {"cp": cp} if family.inputs_run_a_recurrence else {}

    def per_rank(*a):
        return dcp.run(
            recurrence,
            family.inputs(*a[:-1], **sharded),
            initial_state=a[-1],
            block_size=block_size,
            cp=cp,
        )

    o, final, grads = value_and_grad_fn(per_rank, len(family.arg_names) + 1, cp=2)(*args, h0)
    expected_o, expected_h = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, expected_h) <= 1e-5
    _check_gradients(family, args, h0, grads)


# ---------------------------------------------------------------------------------------
# Infinite decays and non-finite inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(
            f,
            id=f.name,
            marks=()
            if f.name in ("gated_delta_rule", "kimi_delta_attention")
            else pytest.mark.slow,
        )
        for f in FAMILIES
        if f.gate is not None
    ],
)
def test_infinite_decays_match_loop(family):
    # g = -inf is a decay of exp(-inf) = 0: the state is forgotten, everything stays finite,
    # chunked, token by token and under context parallelism, and so do the gradients.
    args, h0 = family.make(51, **SHAPE)
    args = list(args)
    gi = family.gate_index()
    assert gi is not None
    g = np.array(args[gi])
    if family.gate_per_channel:
        g[:, 13, :, :3] = -np.inf
        g[:, 21] = -np.inf
    else:
        g[:, 13] = -np.inf
        g[:, 21:23] = -np.inf
    args[gi] = jnp.asarray(g)
    expected_o, expected_h = _reference(family, args, h0)
    assert np.all(np.isfinite(expected_o))
    for kind, cp in [("chunk", None), ("recurrent", None), ("chunk", 2)]:
        o, final, grads = _grad_fn(family, kind, cp)(*args, h0)
        assert rel_err(o, expected_o) <= 1e-5, (kind, cp)
        assert rel_err(final, expected_h) <= 1e-5, (kind, cp)
        assert all(np.all(np.isfinite(x)) for x in grads), (kind, cp)
    # The gradients equal those at a finite decay that underflows to the same zero.
    g[np.isinf(g)] = -1e30
    _, _, finite_grads = _grad_fn(family)(*[*args[:gi], jnp.asarray(g), *args[gi + 1 :]], h0)
    _, _, grads = _grad_fn(family)(*args, h0)
    for i, (a, b) in enumerate(zip(grads, finite_grads)):
        if i != gi:
            assert rel_err(a, b) <= 1e-6


_NON_FINITE_FAST = {
    ("gated_delta_rule", "one_device"),
    ("kimi_delta_attention", "cp"),
    ("gla_per_head", "packed"),
    ("gdn2", "packed"),
    ("dplr", "cp"),
}


@pytest.mark.parametrize(
    "family, where",
    pairwise(
        [FAMILIES, ["one_device", "cp", "packed"]],
        ids=[_name, str],
        # Every place in the default run, and five families (every kind of map, gates per
        # head and per channel, erase and write gates); the rest `slow`.
        fast=lambda f, where: (f.name, where) in _NON_FINITE_FAST,
    ),
)
def test_non_finite_input_does_not_reach_earlier_tokens(family, where):
    # NaN, +inf or -inf in one input at token t: the outputs before t are the float64 loop's
    # on the same inputs (as if the value were absent), from t on they are non-finite, and
    # the gradients of a loss on the tokens before t are finite and the clean ones. An input
    # that reaches only the outputs (a query): only token t's outputs are non-finite, as in
    # the loop, and the gradients of a loss on every other token are the clean ones.
    t = 13  # inside the second chunk of 8; on rank 0 of 2 (20 tokens each)
    args, h0 = family.make(52, **SHAPE)
    cu = [0, 9, 30, 40]  # packed: t in the second document; the third stays clean
    bad_values = [np.nan, np.inf, -np.inf]
    for n, name in enumerate(family.arg_names):
        value = bad_values[n % 3]
        if name == family.gate and value == -np.inf:
            value = np.nan  # -inf is a valid log decay
        broken = list(args)
        x = np.array(broken[n])
        x[:, t] = value
        broken[n] = jnp.asarray(x)
        if name in family.output_only:
            _check_output_only(family, where, args, broken, h0, t, name)
            continue
        if where == "packed":
            o, finals = _packed_fn(family, tuple(cu))(broken)
            expected_o, expected_h = _reference(family, args, None, cu_seqlens=cu)
            o, e = np.asarray(o, np.float64), np.asarray(expected_o)
            assert rel_err(o[:, :t], e[:, :t]) <= 1e-5, name
            assert rel_err(o[:, 30:], e[:, 30:]) <= 1e-5, name
            assert not np.any(np.isfinite(o[:, t:30])), name
            assert rel_err(finals[np.array([0, 2])], expected_h[np.array([0, 2])]) <= 1e-5
            assert not np.any(np.isfinite(finals[1])), name
            continue
        cp = 2 if where == "cp" else None
        o, final, _ = _grad_fn(family, "chunk", cp)(*broken, h0)
        expected_o, _ = _reference(family, args, h0)
        o = np.asarray(o, np.float64)
        assert rel_err(o[:, :t], np.asarray(expected_o)[:, :t]) <= 1e-5, name
        assert not np.any(np.isfinite(o[:, t:])), name
        assert not np.any(np.isfinite(final)), name
        grads = _prefix_grad_fn(family, cp, t)(broken, h0)
        clean = _prefix_grad_fn(family, cp, t)(list(args), h0)
        for i, (a, b) in enumerate(zip(grads, clean)):
            a, b = np.asarray(a), np.asarray(b)
            if i < len(family.arg_names):  # per token: only those before t
                a, b = a[:, :t], b[:, :t]
            assert np.all(np.isfinite(a)), (name, i)
            assert rel_err(a, b) <= 1e-5, (name, i)


def _check_output_only(family: Family, where: str, args, broken, h0, t: int, name: str):
    """`broken` holds a non-finite value in an output-only input at token `t`: only that
    token's outputs are non-finite, the rest and the final states are the float64 loop's
    on `broken`, and the gradients of a loss on every other token are the clean ones."""
    cp = 2 if where == "cp" else None
    if where == "packed":
        cu = [0, 9, 30, 40]  # t in the second document
        o, final = _packed_fn(family, tuple(cu))(broken)
        expected_o, expected_h = _reference(family, broken, None, cu_seqlens=cu)
    else:
        o, final, _ = _grad_fn(family, "chunk", cp)(*broken, h0)
        expected_o, expected_h = _reference(family, broken, h0)
    o = np.asarray(o, np.float64)
    assert not np.any(np.isfinite(o[:, t])), name
    assert not np.any(np.isfinite(expected_o[:, t])), name
    others = np.arange(o.shape[1]) != t
    assert rel_err(o[:, others], expected_o[:, others]) <= 1e-5, name
    assert np.all(np.isfinite(final)), name
    assert rel_err(final, expected_h) <= 1e-5, name
    if where == "packed":
        return
    grads = _prefix_grad_fn(family, cp, t, only=True)(broken, h0)
    clean = _prefix_grad_fn(family, cp, t, only=True)(list(args), h0)
    for i, (a, b) in enumerate(zip(grads, clean)):
        assert np.all(np.isfinite(a)), (name, i)
        assert rel_err(a, b) <= 1e-5, (name, i)


@ft.cache
def _packed_fn(family: Family, cu: tuple[int, ...]):
    """`jax.jit` of `family.chunk` on documents packed at `cu`: one compilation per family."""
    return jax.jit(lambda a: family.chunk(*a, cu_seqlens=list(cu), **_options(family)))


@ft.cache
def _prefix_grad_fn(family: Family, cp: int | None, t: int, only: bool = False):
    """Gradients of a loss on the outputs before token `t` (one device or inside shard_map);
    with `only`, on the outputs of every token but `t`."""

    def outputs(*a):
        if cp is None:
            return family.chunk(*a[:-1], initial_state=a[-1], **_options(family))[0]
        mesh = _mesh(cp)
        seq = P(None, "cp")

        def per_rank(*a):
            kw = dict(initial_state=a[-1], **_options(family), cp=dcp.ContextParallel("cp"))
            return family.chunk(*a[:-1], **kw)[0]

        specs = (seq,) * (len(a) - 1) + (P(),)
        return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=seq)(*a)

    def loss(args, h0):
        o = outputs(*args, h0)
        tokens = jnp.arange(o.shape[1])
        before = (tokens != t if only else tokens < t).reshape(1, -1, 1, 1)
        # Mask first: sin'(NaN) * 0 would be NaN.
        return jnp.sum(jnp.sin(jnp.where(before, o, jnp.zeros((), o.dtype))))

    grad = jax.jit(lambda args, h0: _flatten_grads(jax.grad(loss, argnums=(0, 1))(args, h0)))
    if cp is None:
        return grad
    mesh = _mesh(cp)

    def call(args, h0):
        args = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in args]
        return grad(args, jax.device_put(h0, NamedSharding(mesh, P())))

    return call


def _flatten_grads(grads):
    args, h0 = grads
    return [*args, h0]


@pytest.mark.parametrize("family", _families(lambda i, f: i == 0))
def test_chunk_size_is_capped_by_the_sequence(family):
    # A chunk far longer than the sequence used to be all padding (4 GiB of temporaries at
    # T = 50 with chunk_size=16384); it is capped at the length rounded up to a power of 2.
    args, h0 = family.make(53, **dict(SHAPE, t=50))

    def temporaries(chunk_size):
        fn = jax.jit(
            lambda args, h0: family.chunk(
                *args, initial_state=h0, **_options(family, chunk_size=chunk_size)
            )
        )
        compiled = fn.lower(args, h0).compile()
        memory = compiled.memory_analysis()
        assert memory is not None
        return compiled, memory.temp_size_in_bytes

    big, big_bytes = temporaries(16384)
    _, small_bytes = temporaries(64)
    assert big_bytes == small_bytes
    o, _ = big(args, h0)
    expected_o, _ = _reference(family, args, h0)
    assert rel_err(o, expected_o) <= 1e-5

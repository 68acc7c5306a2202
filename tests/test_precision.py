"""The precision policy: `"highest"` is today's float32 numerics bit for bit, `None` follows
the inputs' dtype, and under `"bfloat16"` the large products take bfloat16 operands with
float32 accumulation while the state, the decays and the chunk maps stay float32.

Accuracy is measured as flash-linear-attention does (`get_err_ratio`, the relative RMS
error `rms(a - b) / rms(b)`) against the float64 token loops of tests/helpers.py on the
same bfloat16-rounded inputs. Gradients are compared with the float64 token-by-token path
(`recurrent_X` with float64 inputs), itself checked against central differences of the
float64 loop along a random direction where it is first formed (once per case and process).
"""

import functools as ft
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp._hlo import Product, products
from deltanet_cp._precision import einsum

from ._fast_compile import fast_compiling
from .helpers import directional_check
from .registry import DPLR, FAMILIES, Family, GATED_DELTA_RULE


OUT_STATE_TOL = 5e-3
GRAD_TOL = 8e-3
FAST = dict(b=1, h=1, hv=2, dk=16, dv=16)


def _fast_first(families, fast):
    """`families` as parameters, all but those in `fast` marked slow (the default run
    stays short)."""
    return [f if f in fast else pytest.param(f, marks=pytest.mark.slow) for f in families]


@pytest.fixture
def fast_compile_if_slow(request):
    """The slow grids' programs compile fast (tests/_fast_compile.py): the arithmetic as
    written, bfloat16 roundings included, where XLA's optimisations may keep more precision
    than a program asks for (`xla_allow_excess_precision`). The default run's cases, the
    structure of the products and cp = 32 keep XLA's defaults: what users compile."""
    if request.node.get_closest_marker("slow") is None:
        yield
    else:
        with fast_compiling():
            yield


def err_ratio(actual, expected) -> float:
    """flash-linear-attention's `get_err_ratio`: `rms(actual - expected) / rms(expected)`."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((a - e) ** 2)) / np.sqrt(np.mean(e**2)))


def _kw(family: Family) -> dict:
    return {"use_qk_l2norm": True} if family.l2norm else {}


def _weights(o, h):
    wo = np.cos(np.arange(o.size)).reshape(o.shape)
    wh = np.sin(np.arange(h.size)).reshape(h.shape)
    return wo, wh


def _loss(o, h):
    wo, wh = _weights(o, h)
    return jnp.sum(o.astype(jnp.float32) * wo.astype(np.float32)) + jnp.sum(
        h * wh.astype(np.float32)
    )


# --- the policy einsum ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, a_shape, b_shape",
    [
        ("bhck,bhkv->bhcv", (2, 3, 5, 4), (2, 3, 4, 6)),
        ("...ij,...jd->...id", (7, 5, 5), (3, 7, 5, 4)),  # a broadcast over a leading axis
        ("...ik,...jk->...ij", (2, 1, 5, 4), (2, 3, 6, 4)),  # and over a unit axis
        ("abk,k->ab", (2, 3, 4), (4,)),
    ],
)
def test_bfloat16_einsum_and_its_vjp(spec, a_shape, b_shape):
    """Forward and VJP: the products of the bfloat16-rounded operands (and cotangent),
    accumulated in float32; the cotangents come back in the operands' dtype and shape."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=a_shape), jnp.float32)
    b = jnp.asarray(rng.normal(size=b_shape), jnp.float32)

    def bf16(x):
        return np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32), np.float64)

    @jax.jit
    def run(a, b, g):
        out, pull = jax.vjp(lambda a, b: einsum(spec, a, b, precision="bfloat16"), a, b)
        return out, pull(g)

    out_shape = np.einsum(spec, np.zeros(a_shape), np.zeros(b_shape)).shape
    g = jnp.asarray(rng.normal(size=out_shape), jnp.float32)
    out, (da, db) = run(a, b, g)
    assert out.dtype == da.dtype == db.dtype == jnp.float32
    assert da.shape == a.shape and db.shape == b.shape
    with jax.enable_x64(True):
        ref = np.einsum(spec, bf16(a), bf16(b))
        _, pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), bf16(a), bf16(b))
        ref_da, ref_db = pull(jnp.asarray(bf16(g)))
    for x, r in [(out, ref), (da, ref_da), (db, ref_db)]:
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_bfloat16x3_einsum_and_its_vjp():
    """The compensated product and its VJP: float32's to about 2^-16 where bfloat16's are
    off by about 2^-9."""
    spec = "bhck,bhkv->bhcv"
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.normal(size=(2, 3, 24, 16)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(2, 3, 16, 8)), jnp.float32)
    g = jnp.asarray(rng.normal(size=(2, 3, 24, 8)), jnp.float32)

    def run(precision):
        out, pull = jax.vjp(lambda a, b: einsum(spec, a, b, precision=precision), a, b)
        return out, *pull(g)

    with jax.enable_x64(True):
        a64, b64, g64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (a, b, g))
        out, pull = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), a64, b64)
        exact = [np.asarray(x) for x in (out, *pull(g64))]
    compensated = jax.jit(run, static_argnums=0)("bfloat16x3")
    rounded = jax.jit(run, static_argnums=0)("bfloat16")
    for x3, x1, x in zip(compensated, rounded, exact):
        assert x3.dtype == jnp.float32
        assert err_ratio(x3, x) < 3e-5 < 5e-4 < err_ratio(x1, x)


def test_bad_policy_names_the_accepted_values(without_runtime_typecheck):
    with pytest.raises(ValueError, match="'highest', 'bfloat16', 'default'"):
        dcp.GatedDeltaRule(precision="float16")  # pyright: ignore[reportArgumentType]
    args, h0 = GATED_DELTA_RULE.make(0, t=8)
    with pytest.raises(ValueError, match="`precision` must be one of"):
        dcp.chunk_gated_delta_rule(*args, precision="fp8")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="two operands"):
        einsum("ij,jk,kl->il", *(jnp.ones((2, 2)),) * 3, precision="bfloat16")


# --- float32 inputs: the default is "highest", bit for bit --------------------------------


@pytest.mark.parametrize("family", _fast_first(FAMILIES, [GATED_DELTA_RULE]), ids=repr)
@pytest.mark.usefixtures("fast_compile_if_slow")
def test_float32_default_is_highest_bitwise(family):
    args, h0 = family.make(1, b=1, t=24, h=1, hv=2, dk=8, dv=6)

    def value_and_grad(precision):
        def loss(args, h0):
            o, h = family.chunk(
                *args, initial_state=h0, chunk_size=8, precision=precision, **_kw(family)
            )
            return _loss(o, h), (o, h)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(args, h0)

    (_, (o1, h1)), g1 = value_and_grad(None)
    (_, (o2, h2)), g2 = value_and_grad("highest")
    assert o1.dtype == jnp.float32 and h1.dtype == jnp.float32
    for x, y in zip(jax.tree.leaves((o1, h1, g1)), jax.tree.leaves((o2, h2, g2))):
        assert x.dtype == y.dtype and bool(jnp.all(x == y))


# --- bfloat16: accuracy against the float64 loops ------------------------------------------


def _bf16_case(family: Family, seed: int, **shape):
    """bfloat16 inputs, their float64 values (what the loop sees) and a float32 state."""
    args, h0 = family.make(seed, dtype=jnp.bfloat16, **shape)
    return args, [np.asarray(a.astype(jnp.float32), np.float64) for a in args], h0


def _reference_loss(family: Family):
    def loss(arrays):
        *a, h0 = arrays
        o, h = family.reference(*a, initial_state=h0, l2norm=family.l2norm)
        wo, wh = _weights(o, h)
        return float(np.sum(o * wo) + np.sum(h * wh))

    return loss


@ft.cache
def _float64_reference(family: Family, seed: int, t: int, shape: tuple) -> tuple:
    """The float64 loop's outputs and final state for `_bf16_case(family, seed, t, **shape)`
    and the gradients of the float64 token-by-token path, checked against central
    differences of the loop along a random direction: once per case (a test compares
    several runs of the policy with one reference). The token path is a reference, not what
    is measured: it compiles fast (tests/_fast_compile.py)."""
    _, args64, h0 = _bf16_case(family, seed, t=t, **dict(shape))
    ref_o, ref_h = family.reference(*args64, initial_state=h0, l2norm=family.l2norm)
    with fast_compiling(), jax.enable_x64(True):
        args = [jnp.asarray(a) for a in args64]
        h0_64 = jnp.asarray(h0, jnp.float64)

        def loss(args, h0):
            o, h = family.recurrent(*args, initial_state=h0, **_kw(family))
            wo, wh = _weights(o, h)
            return jnp.sum(o * wo) + jnp.sum(h * wh)

        grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(args, h0_64)
        grads = [np.asarray(g) for g in jax.tree.leaves(grads)]
    checks = directional_check(grads, _reference_loss(family), [*args64, h0])
    assert max(checks) < 1e-5, checks  # the float64 gradients are the loop's
    return ref_o, ref_h, grads


def _errors(family: Family, t: int, *, cp=None, layout=None, cu_seqlens=None, seed=3, **shape):
    """Relative RMS errors of the bfloat16 policy's outputs, final state and gradients."""
    args, args64, h0 = _bf16_case(family, seed, t=t, **shape)
    if cu_seqlens is not None:  # one initial state per document
        docs = len(cu_seqlens) - 1
        h0 = jnp.concatenate([h0 * (1.0 - 0.1 * n) for n in range(docs)])
    mesh = None if cp is None else jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    ctx = (
        None
        if cp is None
        else dcp.ContextParallel("cp", mesh=mesh, layout=layout or dcp.Contiguous())
    )
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}

    def loss(args, h0):
        o, h = family.chunk(*args, initial_state=h0, chunk_size=64, cp=ctx, **extra, **_kw(family))
        return _loss(o, h), (o, h)

    if mesh is not None:  # the caller's arrays placed on the `Explicit` mesh, packed too
        args = [jax.device_put(a, NamedSharding(mesh, P(None, "cp"))) for a in args]
    (_, (o, h)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(args, h0)
    assert o.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    if cu_seqlens is not None:
        ref_o, ref_h = family.reference(
            *args64, initial_state=h0, l2norm=family.l2norm, cu_seqlens=cu_seqlens
        )
        return {"out": err_ratio(o, ref_o), "state": err_ratio(h, ref_h)}
    ref_o, ref_h, ref_grads = _float64_reference(family, seed, t, tuple(sorted(shape.items())))
    grad = max(err_ratio(g, r) for g, r in zip(jax.tree.leaves(grads), ref_grads))
    return {"out": err_ratio(o, ref_o), "state": err_ratio(h, ref_h), "grad": grad}


def _assert_within(errors: dict):
    assert errors["out"] <= OUT_STATE_TOL, errors
    assert errors["state"] <= OUT_STATE_TOL, errors
    if "grad" in errors:
        assert errors["grad"] <= GRAD_TOL, errors


WIDE = dict(b=1, h=2, hv=4, dk=32, dv=32)


@pytest.mark.parametrize("family", _fast_first(FAMILIES, [GATED_DELTA_RULE]), ids=repr)
@pytest.mark.usefixtures("fast_compile_if_slow")
def test_bfloat16_accuracy(family):
    _assert_within(_errors(family, 256, **FAST))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES, ids=repr)
@pytest.mark.usefixtures("fast_compile_if_slow")
def test_bfloat16_accuracy_long(family):
    _assert_within(_errors(family, 4096, **WIDE))


_LAYOUTS = (dcp.Contiguous(), dcp.Zigzag())
# One (layout, cp) per kind, cycling so that every layout meets every cp = 2, 4, 8.
_CP_CASES = [(f, _LAYOUTS[i % 2], (2, 4, 8)[i % 3]) for i, f in enumerate(FAMILIES)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, layout, cp",
    _CP_CASES,
    ids=[f"{f!r}-{type(lay).__name__}-cp{cp}" for f, lay, cp in _CP_CASES],
)
@pytest.mark.usefixtures("fast_compile_if_slow")
def test_bfloat16_accuracy_cp(family, layout, cp):
    """The error does not grow with the ranks: the chunk maps and their exchange are
    float32. Packed documents too (contiguous layout). The growth is checked before the
    bounds."""
    one = _errors(family, 1024, **WIDE)
    many = _errors(family, 1024, cp=cp, layout=layout, **WIDE)
    for name in one:
        assert many[name] <= 1.1 * one[name] + 1e-4, (cp, name, one, many)
    _assert_within(one)
    _assert_within(many)
    if isinstance(layout, dcp.Contiguous):
        docs = [0, 100, 612, 700, 1024]
        one = _errors(family, 1024, cu_seqlens=docs, **{**WIDE, "b": 1})
        many = _errors(family, 1024, cp=cp, cu_seqlens=docs, **{**WIDE, "b": 1})
        _assert_within(one)
        _assert_within(many)
        for name in one:
            assert many[name] <= 1.1 * one[name] + 1e-4, (name, one, many)


@pytest.mark.slow
def test_bfloat16_accuracy_cp32():
    """cp = 32 on 32 simulated devices (a process of its own)."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=32"
    code = (
        "import jax, json; from tests import test_precision as t; "
        "print(json.dumps([t._errors(t.GATED_DELTA_RULE, 4096, **t.WIDE), "
        "t._errors(t.GATED_DELTA_RULE, 4096, cp=32, **t.WIDE)]))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    )
    one, many = json.loads(done.stdout.strip().splitlines()[-1])
    _assert_within(one)
    _assert_within(many)
    for name in one:
        assert many[name] <= 1.1 * one[name] + 1e-4, (name, one, many)


def test_bfloat16_policy_on_float32_inputs():
    """`precision="bfloat16"` on float32 inputs: float32 outputs, within the bfloat16
    bound of the loop; `"highest"` one argument away on bfloat16 inputs."""
    family = GATED_DELTA_RULE
    args, h0 = family.make(5, t=128, **FAST)
    args64 = [np.asarray(a, np.float64) for a in args]
    ref_o, ref_h = family.reference(*args64, initial_state=h0, l2norm=True)
    o, h = family.chunk(*args, initial_state=h0, precision="bfloat16", **_kw(family))
    assert o.dtype == h.dtype == jnp.float32
    assert 1e-6 < err_ratio(o, ref_o) <= OUT_STATE_TOL  # rounded, but within the bound
    b16 = [a.astype(jnp.bfloat16) for a in args]
    b64 = [np.asarray(a.astype(jnp.float32), np.float64) for a in b16]
    ref_o, ref_h = family.reference(*b64, initial_state=h0, l2norm=True)
    o, h = family.chunk(*b16, initial_state=h0, precision="highest", **_kw(family))
    assert o.dtype == jnp.bfloat16
    assert err_ratio(h, ref_h) < 1e-5  # exact products: only the outputs' rounding is left


# --- the structure: what an accelerator multiplies -------------------------------------------

# The products that stay float32 under the bfloat16 policy, by the function that emits them:
# the log decays' segment sums (a sum of gates as a product with a 0/1 tensor), the levels
# of the unit-lower inverse (I + A)^-1 and its VJP, and the chunk maps and their composition
# (context parallelism only).
FLOAT32_PLACES = (
    "segment_sums",
    "_inverse_pow2",
    "_unit_lower_inverse_bwd",
    "_affine.py",
    "_momentum_decays",  # the momentum rule's 2 x 2 decays between tokens
)


def census(family: Family, *, grad: bool, cp: int | None = None) -> list[Product]:
    """The `dot_general`s of `chunk_X` on bfloat16 inputs, lowered for a GPU (XLA:CPU
    multiplies the rounded operands in float32 instead: its runtime has no bfloat16 x
    bfloat16 -> float32 dot for every layout)."""
    args, h0 = family.make(0, dtype=jnp.bfloat16, t=128, **FAST)
    ctx = None if cp is None else dcp.ContextParallel("cp")
    mesh = None if cp is None else jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])

    def fwd(args, h0):
        return family.chunk(*args, initial_state=h0, chunk_size=32, cp=ctx, **_kw(family))

    if mesh is not None:
        fwd = jax.shard_map(
            fwd, mesh=mesh, in_specs=(P(None, "cp"), P()), out_specs=(P(None, "cp"), P())
        )

    def fn(args, h0):
        return (
            jax.grad(lambda a, h: _loss(*fwd(a, h)), argnums=(0, 1))(args, h0)
            if grad
            else fwd(args, h0)
        )

    text = export.export(jax.jit(fn), platforms=["cuda"])(args, h0).mlir_module()
    return products(text)


# Where a module keeps no source frames for a product (the backward's, transposed inside the
# engine's own VJP), the float32 ones are told by their subscripts: the segment sums' and the
# inverse's levels' (the bfloat16 products of the same subscripts keep bfloat16 operands).
FLOAT32_SPECS = {
    "...t,tij->...ij": "segment_sums",
    "...ij,...jk->...ik": "_inverse_pow2",
    "...ti,...ij->...tj": "_momentum_decays",
    "...ti,...i->...t": "_momentum_decays",
    "...kv,...kv->...k": "decay_cotangent",  # the chunk decay's, from the float32 states
}


def float32_place(p: Product) -> str | None:
    """The named place a float32 product belongs to, or `None`."""
    for frame in p.frames:
        for place in FLOAT32_PLACES:
            if place in frame:
                return place
    ours = any(
        f"{d}/" in f or "_delta" in f or "_gla" in f or "_dplr" in f
        for f in p.frames
        for d in ("recurrences", "chunkops")
    )
    return None if ours else FLOAT32_SPECS.get(p.spec)


@pytest.mark.parametrize("family", _fast_first(FAMILIES, [GATED_DELTA_RULE, DPLR]), ids=repr)
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "backward"])
def test_structure_bfloat16_products(family, grad):
    """Every product takes bfloat16 operands and accumulates in float32, but the named
    float32 ones (decay sums, the unit-lower inverse): forward and the hand-written backward."""
    found = census(family, grad=grad)
    bf16 = [p for p in found if p.operands == ("bf16", "bf16")]
    f32 = [p for p in found if p.operands != ("bf16", "bf16")]
    assert bf16 and all(p.result == "f32" for p in bf16)
    wrong = [(p.spec, p.where(), p.operands) for p in f32 if float32_place(p) is None]
    assert not wrong, wrong
    assert all(p.operands == ("f32", "f32") and p.result == "f32" for p in f32)

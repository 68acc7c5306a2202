"""Stacked, scanned decoder layers (`scan_layers=True`, `Qwen3_5LayerStack`) and the
rematerialisation policies (`remat=`) of the Qwen3.5-family models: the stack reads as the
tuple of layers it replaces; the scanned forward equals the loop's bit for bit and its
gradients to float32 rounding; prefill and decoding on the stack; a ("dp", "cp") training
step of the scanned model equals one device's; every remat policy gives the loop's gradients.

transformers' logits for the scanned form: tests/test_qwen3_5.py and tests/test_qwen3_moe.py
(`test_logits_match_transformers`, `test_logits_and_aux_loss_match_transformers`); checkpoints
written from the stacked form: tests/test_save_pretrained.py.

The model is the tied fixture of tests/test_qwen3_5.py (layer types [linear, full, linear,
full]: a period of two layers, two groups) and a random Qwen3-Next of the same pattern with
every feed-forward sparse.
"""

import functools as ft
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.models import (
    Qwen3_5ForCausalLM,
    Qwen3_5LayerStack,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from deltanet_cp.nn import expert_partition_specs, load_balancing_loss

from .helpers import rel_err


pytestmark = pytest.mark.usefixtures("fast_compile")
DATA = pathlib.Path(__file__).parent / "data"
CHUNK = 8


@ft.cache
def _dense(scan: bool) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM.from_pretrained(
        DATA / "qwen3_5_lm_tied", chunk_size=CHUNK, scan_layers=scan
    )


@ft.cache
def _moe(scan: bool, abstract: bool = False) -> Qwen3NextForCausalLM:
    fields = json.loads((DATA / "qwen3_next_moe" / "config.json").read_text())
    fields.update(
        layer_types=["linear_attention", "full_attention"] * 2,
        mlp_only_layers=[],
        tie_word_embeddings=True,
    )
    config = Qwen3NextConfig.from_hf(fields)
    build = eqx.filter_eval_shape if abstract else (lambda f, *a, **k: f(*a, **k))
    return build(Qwen3NextForCausalLM, config, chunk_size=4, scan_layers=scan, key=jr.key(0))


def _tokens(n: int = 24, vocab: int = 64) -> jax.Array:
    return (jnp.arange(n) * 7 + 3) % vocab


def _loss(model, tokens, remat="none"):
    """Next-token loss (and the load-balancing loss of a mixture-of-experts model); the
    logits (and router statistics) as its aux."""
    if model.config.is_sparse(0):
        out = logits, stats = model.logits_and_router_stats(tokens, remat=remat)
        aux = load_balancing_loss(stats)
    else:
        out = logits = model(tokens, remat=remat)
        aux = jnp.zeros((), jnp.float32)
    logp = jax.nn.log_softmax(logits[:-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], -1)) + aux, out


def _unstacked(tree):
    """A model (or its gradients) with its layers as the tuple they stack."""
    if isinstance(tree.layers, Qwen3_5LayerStack):
        return eqx.tree_at(lambda m: m.layers, tree, tree.layers.unstack())
    return tree


@ft.cache
def _value_and_grad(which: str, scan: bool, remat: str = "none"):
    """`((loss, outputs), gradients)` of `_loss`, the gradients' layers unstacked."""
    model = {"dense": _dense, "moe": _moe}[which](scan)
    f = eqx.filter_value_and_grad(ft.partial(_loss, remat=remat), has_aux=True)
    value, grads = eqx.filter_jit(f)(model, _tokens())
    return value, _unstacked(grads)


def test_stack_reads_as_its_layers():
    loop, stack = _dense(False), _dense(True)
    layers = stack.layers
    assert isinstance(layers, Qwen3_5LayerStack)
    assert (len(layers.period), layers.num_groups, len(layers.rest)) == (2, 2, 0)
    assert len(layers) == 4
    for i in (0, 1, 2, 3, -1):
        assert eqx.tree_equal(layers[i], loop.layers[i])
    assert eqx.tree_equal(list(layers), list(loop.layers))
    assert eqx.tree_equal(Qwen3_5LayerStack.stack(layers.unstack()), layers)
    with pytest.raises(IndexError):
        layers[4]
    # A pattern that does not fill the last period keeps the rest unstacked.
    five = Qwen3_5LayerStack.stack(list(loop.layers) + [loop.layers[0]])
    assert (five.num_groups, len(five.rest), len(five)) == (2, 1, 5)
    # An abstract model (`equinox.filter_eval_shape`) reads the same way.
    abstract = _moe(True, abstract=True)
    experts = abstract.layers[3].mlp.experts.gate_proj  # type: ignore[union-attr]
    assert len(abstract.layers) == 4 and experts.shape == (8, 8, 24)


def test_bad_knobs_are_refused(without_runtime_typecheck):
    with pytest.raises(TypeError, match="scan_layers"):
        Qwen3_5ForCausalLM(_dense(False).config, scan_layers="yes", key=jr.key(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`remat` must be one of"):
        _dense(True)(_tokens(), remat="full")  # type: ignore[arg-type]


@pytest.mark.parametrize("which", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_scanned_forward_and_gradients_equal_the_loop(which):
    if which == "moe":
        # Random parameters: the same with and without stacking.
        assert eqx.tree_equal(_unstacked(_moe(True)), _moe(False))
    (v1, out1), g1 = _value_and_grad(which, True)
    (v0, out0), g0 = _value_and_grad(which, False)
    # The forward (and the router statistics, summed in the loop's order): bit for bit.
    assert eqx.tree_equal(out1, out0) and np.array_equal(v1, v0)
    # The gradients: XLA fuses the backward of a loop body otherwise than the unrolled
    # layers', so they differ in the last bits (at most 4e-7 relative, measured).
    errors = jax.tree.leaves(jax.tree.map(rel_err, g1, g0))
    assert max(errors) <= 2e-6, errors


# About 5 s each; the default run has `remat="layer"` in the scanned training step of
# tests/test_qwen3_moe.py.
@pytest.mark.slow
@pytest.mark.parametrize("remat", ["feed_forward", "layer"])
def test_remat_policies_give_the_same_gradients(remat):
    # (`remat="layer"` also in the training step over dp and cp below.)
    (value, out), grads = _value_and_grad("dense", True, remat)
    (v0, out0), g0 = _value_and_grad("dense", True)
    # The same arithmetic in another program: equal up to XLA's rounding.
    assert rel_err(value, v0) <= 1e-6 and rel_err(out, out0) <= 1e-6
    # Under this module's quick compilation the recomputed backward rounds otherwise: up to
    # 1.7e-5 (measured; 0 at XLA's defaults), as two float32 runs of this model summing in
    # different orders differ (tests/test_qwen3_moe.py: one device's gradients are 1.1e-5
    # from float64).
    errors = jax.tree.leaves(jax.tree.map(rel_err, grads, g0))
    assert max(errors) <= 1e-4, errors


def test_scanned_prefill_then_decode():
    # On the stack: a prefill of 20 tokens and 4 decoded ones give the scanned forward's
    # logits.
    model, tokens = _dense(True), _tokens()
    logits, cache = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=24))(model, tokens[:20])
    rows = [logits]
    for token in tokens[20:]:
        step, cache = model.decode_step(token, cache)
        rows.append(step[None])
    (_, forward), _ = _value_and_grad("dense", True)
    assert rel_err(jnp.concatenate(rows), forward) <= 1e-5


@pytest.mark.slow
def test_scanned_packed_documents():
    # Packed documents (`cu_seqlens`, closed over by the scan's body): the loop's logits,
    # bit for bit at XLA's defaults (measured); this module's quick compilation rounds the
    # two programs otherwise.
    f = eqx.filter_jit(lambda m, t: m(t, cu_seqlens=[0, 9, 9, 24]))
    assert rel_err(f(_dense(True), _tokens()), f(_dense(False), _tokens())) <= 1e-5


@pytest.mark.slow
def test_scanned_prefill_and_generation_equal_the_loop():
    # The layers sliced out of the stack are the loop's: prefill, decoding and generation
    # bit for bit.
    tokens = _tokens(16)
    prefill = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=16))
    out = {}
    for scan in (True, False):
        model = _dense(scan)
        logits, cache = prefill(model, tokens[:12])
        rows = [logits]
        for token in tokens[12:]:
            step, cache = model.decode_step(token, cache)
            rows.append(step[None])
        out[scan] = (jnp.concatenate(rows), model.generate(tokens[:4], 3))
    assert eqx.tree_equal(out[True], out[False])


# About 12 s; the default run trains the scanned Qwen3-Next over dp, cp and experts
# (tests/test_qwen3_moe.py).
@pytest.mark.slow
def test_scanned_training_step_over_dp_and_cp():
    # The sequence on both "dp" ranks, each split over cp = 2 ranks (zigzag), the layers
    # scanned and recomputed in the backward (`remat="layer"`): the loss, the logits and
    # every gradient equal one device's loop without remat.
    tokens = _tokens()
    inputs = jnp.stack([tokens] * 2)
    targets = jnp.stack([jnp.roll(tokens, -1)] * 2)
    mask = jnp.ones(targets.shape, jnp.float32).at[:, -1].set(0)  # the last predicts nothing
    params, static = eqx.partition(_dense(True), eqx.is_array)
    mesh = jax.make_mesh(
        (2, 2), ("dp", "cp"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )
    layout, seq = dcp.Zigzag(), P("dp", "cp")
    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, inputs, targets, mask):
        m = eqx.combine(params, static)
        logits = jax.vmap(lambda t: m(t, cp=context, remat="layer"))(inputs)
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)
        total = jax.lax.psum(-jnp.sum(logp[..., 0] * mask), ("dp", "cp"))
        return total / jax.lax.psum(jnp.sum(mask), ("dp", "cp")), logits

    step = jax.shard_map(local, mesh=mesh, in_specs=(P(),) + (seq,) * 3, out_specs=(P(), seq))
    sharded = [
        jax.device_put(layout.to_layout(a, 2), NamedSharding(mesh, seq))
        for a in (inputs, targets, mask)
    ]
    (value, logits), grads = jax.jit(jax.value_and_grad(step, has_aux=True))(params, *sharded)
    (value1, logits1), grads1 = _value_and_grad("dense", False)
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    for row in layout.from_layout(logits, 2):
        assert rel_err(row, logits1) <= 1e-5
    errors = jax.tree.leaves(jax.tree.map(rel_err, _unstacked(grads), grads1))
    assert max(errors) <= 1e-4, errors


def _abstract_array(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def test_expert_specs_of_stacked_layers():
    # The routed experts of a stack are split on their second dimension (the first is the
    # group); every other leaf is replicated.
    params = eqx.filter(_moe(True, abstract=True), _abstract_array)
    specs = expert_partition_specs(params, "ep")
    experts = specs.layers.period[0].mlp.experts
    assert (experts.gate_proj, experts.down_proj) == (P(None, "ep"), P(None, "ep"))
    assert specs.layers.period[0].mlp.gate.weight == P()
    loop = expert_partition_specs(eqx.filter(_moe(False, abstract=True), _abstract_array), "ep")
    assert loop.layers[0].mlp.experts.gate_proj == P("ep")

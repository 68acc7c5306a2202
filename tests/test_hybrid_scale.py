"""`HybridLM` at scale, as the Qwen models (tests/test_layer_stack.py, tests/test_fsdp.py):
blocks stacked by their repeating pattern and scanned (`scan_layers=True`), each block's
rematerialisation (`remat=`), and fully sharded data parallelism (`fsdp=`) in an optax AdamW
training step on a `("dp", "cp")` mesh, equal to one device's; bad input refused with what to
change.

The model is a random four-block one (`[gated_delta_net, attention] * 2`: a period of two
blocks, two groups), and a mixed one with RWKV-7 blocks (the first RWKV-7 block hands its
values to the later ones) whose pattern does not repeat."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn import FSDP, HybridLM, LayerStack, partition_specs

from .helpers import assert_split_as_specs, rel_err


VOCAB, HIDDEN, TOKENS, DP, CP = 16, 16, 16, 2, 2
SIZES: dict[str, Any] = dict(
    num_key_heads=2,
    num_value_heads=2,
    key_head_dim=8,
    value_head_dim=8,
    num_attention_heads=2,
    attention_head_dim=8,
    intermediate_size=32,
    chunk_size=4,
)
MIXED = ("rwkv7", "gated_delta_net", "rwkv7", "gated_delta_net", "rwkv7", "attention")


@ft.cache
def _model(scan: bool, mixed: bool = False) -> HybridLM:
    if mixed:
        return HybridLM(VOCAB, HIDDEN, 6, mixers=MIXED, scan_layers=scan, key=jr.key(1), **SIZES)
    return HybridLM(VOCAB, HIDDEN, 4, attention_every=2, scan_layers=scan, key=jr.key(0), **SIZES)


def _tokens() -> jax.Array:
    return (jnp.arange(TOKENS) * 7 + 3) % VOCAB


def _unstacked(tree):
    """A model's tree (parameters, gradients) with its blocks as a tuple."""
    if not isinstance(tree.blocks, LayerStack):
        return tree
    return eqx.tree_at(lambda m: m.blocks, tree, tree.blocks.unstack())


def _loss(model, tokens, remat="none"):
    logits = model(tokens, remat=remat)
    logp = jax.nn.log_softmax(logits[:-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], -1)), logits


@ft.cache
def _value_and_grad(scan: bool, remat: str = "none", mixed: bool = False, quick: bool = False):
    """`((loss, logits), gradients)` of one sequence, the gradients' blocks unstacked;
    `quick`: called under the quick compilation (a cache entry of its own)."""
    f = eqx.filter_value_and_grad(ft.partial(_loss, remat=remat), has_aux=True)
    value, grads = eqx.filter_jit(f)(_model(scan, mixed), _tokens())
    return value, _unstacked(grads)


def test_stacked_blocks_read_as_the_loop():
    loop, stack = _model(False), _model(True)
    blocks = stack.blocks
    assert isinstance(blocks, LayerStack)
    assert (len(blocks.period), blocks.num_groups, len(blocks.rest)) == (2, 2, 0)
    assert eqx.tree_equal(list(blocks), list(loop.blocks))


# About 50 s (two programs compiled at XLA's defaults); the default run has the scanned
# blocks' gradients in the FSDP training step below (against one device's loop).
@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True])
def test_scanned_forward_and_gradients_equal_the_loop(mixed):
    if mixed:
        # The first RWKV-7 block differs from the later ones (no `v_lora`): nothing
        # repeats, one group of all six blocks, run once (its `v_first` starts there).
        blocks = _model(True, mixed=True).blocks
        assert isinstance(blocks, LayerStack)
        assert (len(blocks.period), blocks.num_groups, len(blocks.rest)) == (6, 1, 0)
        assert eqx.tree_equal(blocks.unstack(), _model(False, mixed=True).blocks)
    (v1, logits1), g1 = _value_and_grad(True, mixed=mixed)
    (v0, logits0), g0 = _value_and_grad(False, mixed=mixed)
    # At XLA's defaults (tests/_fast_compile.py's quick compilation rounds the two programs
    # otherwise: 2e-7 in the logits, 1.1e-5 in the gradients, measured): the forward bit for
    # bit; the gradients to float32 rounding (XLA fuses the backward of a loop body
    # otherwise than the unrolled blocks': 1.9e-7 measured), as the models' scanned layers.
    assert np.array_equal(logits1, logits0) and np.array_equal(v1, v0)
    errors = jax.tree.leaves(jax.tree.map(rel_err, g1, g0))
    assert max(errors) <= 2e-6, errors


# About 14 s each; the default run has `remat="layer"` in the FSDP training step below.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("remat", ["layer", "feed_forward"])
def test_remat_policies_give_the_same_gradients(remat):
    (value, logits), grads = _value_and_grad(False, remat, quick=True)
    (v0, logits0), g0 = _value_and_grad(False, quick=True)
    assert rel_err(value, v0) <= 1e-6 and rel_err(logits, logits0) <= 1e-6
    # The recomputed backward rounds otherwise under the quick compilation, as the
    # models' (tests/test_layer_stack.py).
    errors = jax.tree.leaves(jax.tree.map(rel_err, grads, g0))
    assert max(errors) <= 1e-4, errors


def test_bad_knobs_are_refused(without_runtime_typecheck):
    with pytest.raises(TypeError, match="scan_layers"):
        HybridLM(VOCAB, HIDDEN, 2, scan_layers="yes", key=jr.key(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`remat` must be one of"):
        _model(True)(_tokens(), remat="full")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`remat` must be one of"):
        _model(False).blocks[0](jnp.zeros((4, HIDDEN)), remat=True)  # type: ignore[arg-type]
    # The specs of the loop's parameters for the stacked model, and the other way round.
    mesh = jax.make_mesh((DP,), ("dp",), devices=jax.devices()[:DP])
    for model, other in ((_model(True), _model(False)), (_model(False), _model(True))):
        specs = partition_specs(eqx.filter(other, eqx.is_array), mesh, data_axis="dp")
        with pytest.raises(ValueError, match=r"not of this model's structure.*partition_specs"):
            model(_tokens(), fsdp=FSDP("dp", specs))


def _mesh():
    devices = jax.devices()[: DP * CP]
    return jax.make_mesh((DP, CP), ("dp", "cp"), devices=devices, axis_types=(AxisType.Auto,) * 2)


@ft.cache
def _batch():
    tokens = np.random.default_rng(0).integers(0, VOCAB, (DP, TOKENS + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _batch_loss(model, inputs, targets, axes=(), **kw):
    logits = jax.vmap(lambda t: model(t, **kw))(inputs)
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    count = jnp.asarray(targets.size, jnp.float32)
    if axes:
        nll, count = jax.lax.psum((nll, count), axes)
    return nll / count


def _optimizer():
    return optax.adamw(1e-2, weight_decay=0.1)


@ft.cache
def _one_device():
    """One device, the blocks in a loop: the loss, the gradients and AdamW's new
    parameters."""
    params, static = eqx.partition(_model(False), eqx.is_array)
    optimizer = _optimizer()

    @jax.jit
    def step(params, inputs, targets):
        loss = lambda p: _batch_loss(eqx.combine(p, static), inputs, targets)  # noqa: E731
        value, grads = jax.value_and_grad(loss)(params)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return value, grads, optax.apply_updates(params, updates)

    with jax.numpy_dtype_promotion("standard"):
        return step(params, *_batch())


def _sharded_step(scan: bool, data_axis, remat: str):
    """One AdamW step with every parameter split over `data_axis` by `partition_specs`,
    the batch over "dp", the sequence over "cp" (zigzag): the loss, gradients and new
    parameters, the placed parameters and their specs."""
    mesh, layout, seq = _mesh(), dcp.Zigzag(), P("dp", "cp")
    params, static = eqx.partition(_model(scan), eqx.is_array)
    specs = partition_specs(params, mesh, data_axis=data_axis)
    kw = dict(cp=dcp.ContextParallel("cp", layout=layout), fsdp=FSDP(data_axis, specs), remat=remat)

    def local(params, inputs, targets):
        return _batch_loss(eqx.combine(params, static), inputs, targets, ("dp", "cp"), **kw)

    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=P())
    optimizer = _optimizer()
    state_specs = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, s: s,
        jax.eval_shape(optimizer.init, params),
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )

    @jax.jit
    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates)

    def put(tree, specs):
        return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    placed = put(params, specs)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = put(optimizer.init(params), state_specs)
        batch = [put(layout.to_layout(a, CP), seq) for a in _batch()]
        return step(placed, opt_state, *batch), placed, specs


def _check(scan: bool, data_axis, remat: str = "none"):
    (value, grads, new), placed, specs = _sharded_step(scan, data_axis, remat)
    value1, grads1, new1 = _one_device()
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    # To 1e-4, as the models' FSDP steps (tests/test_fsdp.py): float32 sums in other orders.
    errors = jax.tree.map(rel_err, _unstacked(jax.device_get(grads)), grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    errors = jax.tree.map(rel_err, _unstacked(jax.device_get(new)), new1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    # What the specs split is split, on the devices and in the gradients.
    assert_split_as_specs(specs, _mesh().shape, placed, grads)
    return placed


# About 25 s (one training step compiled under shard_map, and one device's): slow. The
# default run trains HybridLM on ("dp", "cp") (tests/test_data_parallel.py) and the
# models' scanned layers under FSDP through the same runner (tests/test_fsdp.py).
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_scanned_training_step_with_fsdp():
    # The four blocks stacked (two groups of [gated_delta_net, attention]), every parameter
    # split over "dp", each block gathered from its group's slices inside the scan and
    # recomputed in the backward: one device's loop.
    placed = _check(True, "dp", "layer")
    out_proj = placed.blocks.period[0].mixer.out_proj.weight
    assert out_proj.addressable_shards[0].data.shape == (2, HIDDEN // DP, 16)
    assert placed.embed.weight.addressable_shards[0].data.shape == (VOCAB // DP, HIDDEN)


# 20 to 40 s each.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "scan, data_axis, remat",
    [(False, "dp", "none"), (False, ("dp", "cp"), "feed_forward"), (True, ("dp", "cp"), "none")],
)
def test_training_step_with_fsdp_grid(scan, data_axis, remat):
    _check(scan, data_axis, remat)

"""Fully sharded data parallelism (`deltanet_cp.nn.partition_specs`, `gather_params`,
`FSDP`): an optax AdamW training step of Qwen3.5 dense and Qwen3.5 MoE on a `("dp", "cp")`
mesh with every parameter split over the data axis (and the experts over their axis) gives
one device's loss, gradients and new parameters, with the layers in a loop and scanned
(`scan_layers=True`); the specs split what they say; bad input is refused with what to
change.

The models are random two-layer ones ([linear, full]) of the fixtures' sizes (five layers,
[linear, full] twice and a linear one, for the scanned ones: two stacked groups and one
layer after them): one training step compiled under `shard_map` per case.
"""

import functools as ft
import json
import pathlib
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from deltanet_cp import ContextParallel
from deltanet_cp.data import chunked_causal_lm_loss
from deltanet_cp.models import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5LayerStack,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
)
from deltanet_cp.nn import FSDP, gather_params, load_balancing_loss, partition_specs

from .helpers import assert_split_as_specs, rel_err


DATA = pathlib.Path(__file__).parent / "data"
DP, CP = 2, 2
TOKENS = 16  # per sequence: 8 per "cp" rank, two chunks of 4
RATE = 1e-2


@ft.cache
def _model(which: str, depth: int = 2, scan: bool = False):
    """A random model of the fixture's sizes, its `depth` layers alternating [linear, full]
    (`"tied"`: the dense one with the LM head the embedding's transpose); with `scan`, its
    layers stacked (the same parameters)."""
    cls, config, folder = {
        "dense": (Qwen3_5ForCausalLM, Qwen3_5Config, "qwen3_5_lm"),
        "tied": (Qwen3_5ForCausalLM, Qwen3_5Config, "qwen3_5_lm"),
        "moe": (Qwen3_5MoeForCausalLM, Qwen3_5MoeConfig, "qwen3_5_moe"),
    }[which]
    fields = json.loads((DATA / folder / "config.json").read_text())
    types = ["linear_attention", "full_attention"] * depth
    fields.update(num_hidden_layers=depth, layer_types=types[:depth])
    fields["tie_word_embeddings"] = which == "tied"
    return cls(config.from_hf(fields), chunk_size=4, scan_layers=scan, key=jr.key(0))


def _mesh():
    devices = jax.devices()[: DP * CP]
    return jax.make_mesh((DP, CP), ("dp", "cp"), devices=devices, axis_types=(AxisType.Auto,) * 2)


@ft.cache
def _batch():
    tokens = np.random.default_rng(0).integers(0, 64, (DP, TOKENS + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _loss(model, inputs, targets, axes=(), **kw):
    """The mean next-token loss (plus the load-balancing loss of a mixture of experts, the
    routing summed over the batch and every rank)."""
    moe = hasattr(model.config, "num_experts")
    if moe:
        logits, stats = jax.vmap(lambda t: model.logits_and_router_stats(t, **kw))(inputs)
        stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
    else:
        logits, stats = jax.vmap(lambda t: model(t, **kw))(inputs), None
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    count = jnp.asarray(targets.size, jnp.float32)
    if axes:
        nll, count, stats = jax.lax.psum((nll, count, stats), axes)
    aux = 0.0 if stats is None else model.config.router_aux_loss_coef * load_balancing_loss(stats)
    return nll / count + aux


def _chunked_loss(model, inputs, targets, axes=(), **kw):
    """`_loss` through the chunked loss: the model's hidden states and head weight, the
    logits computed 4 positions at a time (`chunked_causal_lm_loss`)."""
    moe = hasattr(model.config, "num_experts")
    hidden, stats = jax.vmap(lambda t: model.hidden_states(t, **kw))(inputs)
    weight = model.head_weight(kw.get("fsdp"))
    loss, _ = chunked_causal_lm_loss(hidden, weight, targets, chunk_size=4, axis_name=axes or None)
    if not moe:
        return loss
    stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
    if axes:
        stats = jax.lax.psum(stats, axes)
    return loss + model.config.router_aux_loss_coef * load_balancing_loss(stats)


def _optimizer():
    return optax.adamw(RATE, weight_decay=0.1)


def _opt_specs(optimizer, state, specs):
    """The optimizer state's specs: the parameters' for each moment, `P()` for the rest."""
    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, s: s,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=lambda x: isinstance(x, P),
    )


@ft.cache
def _reference(which: str, depth: int = 2):
    """One device, the layers in a loop: the loss and the gradients."""
    params, static = eqx.partition(_model(which, depth), eqx.is_array)

    def loss(params, inputs, targets):
        return _loss(eqx.combine(params, static), inputs, targets)

    return jax.jit(jax.value_and_grad(loss))(params, *_batch())


def _one_device_update(params, grads):
    """`params` after one device's AdamW step from `grads`."""
    optimizer = _optimizer()

    @jax.jit
    def update(params, grads):
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return optax.apply_updates(params, updates)

    with jax.numpy_dtype_promotion("standard"):
        return update(params, grads)


def _sharded_step(
    which: str, data_axis, expert_axis, depth: int = 2, scan: bool = False, loss_fn=_loss
):
    """The loss, gradients and new parameters of one AdamW step with the parameters split
    by `partition_specs`, the batch over "dp", the sequence over "cp"; and the placed
    parameters."""
    mesh = _mesh()
    params, static = eqx.partition(_model(which, depth, scan), eqx.is_array)
    specs = partition_specs(params, mesh, data_axis=data_axis, expert_axis=expert_axis)
    fsdp = FSDP(data_axis, specs)
    seq = P("dp", "cp")
    context = ContextParallel("cp")
    kw = dict(cp=context, fsdp=fsdp, **({"expert_axis": expert_axis} if expert_axis else {}))

    def local(params, inputs, targets):
        return loss_fn(eqx.combine(params, static), inputs, targets, ("dp", "cp"), **kw)

    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=P())
    optimizer = _optimizer()
    state = jax.eval_shape(optimizer.init, params)
    state_specs = _opt_specs(optimizer, state, specs)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), opt_state

    def put(tree, specs):
        return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    placed = put(params, specs)
    with jax.numpy_dtype_promotion("standard"):
        opt_state = put(optimizer.init(params), state_specs)
        inputs, targets = (put(x, seq) for x in _batch())
        value, grads, new, new_state = step(placed, opt_state, inputs, targets)
    return (value, grads, new), placed, specs, new_state, state_specs


@pytest.mark.usefixtures("fast_compile_one_test")
def test_hidden_states_and_head_weight_give_the_logits():
    # The final hidden states times the head's weight are the logits; the routing
    # statistics are logits_and_router_stats'. Tied, the head's weight is the embedding's
    # (the slow FSDP step below trains through it).
    tied = _model("tied")
    assert tied.head_weight() is tied.embed.weight
    model = _model("moe")
    assert model.lm_head is not None and model.head_weight() is model.lm_head.weight
    inputs = _batch()[0][0]

    @eqx.filter_jit
    def both(model):
        hidden, stats = model.hidden_states(inputs)
        return *model.logits_and_router_stats(inputs), hidden @ model.head_weight().T, stats

    logits, stats, product, got = both(model)
    assert eqx.tree_equal(got, stats)
    assert rel_err(product, logits) <= 1e-6


# About 20 s each.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "which, expert_axis", [("tied", None), ("moe", ("dp", "cp"))], ids=["tied", "moe"]
)
def test_chunked_loss_training_step_with_fsdp(which, expert_axis):
    # The chunked loss from the gathered head (the tied embedding's) under FSDP: one
    # device's loss (of the full logits), gradients and step.
    _check(which, "dp", expert_axis, loss_fn=_chunked_loss)


def _shard_shape(x) -> tuple[int, ...]:
    shapes = {s.data.shape for s in x.addressable_shards}
    assert len(shapes) == 1, shapes
    return next(iter(shapes))


def _unstacked(tree):
    """A model's tree (parameters, gradients) with its layers as a tuple."""
    if not isinstance(tree.layers, Qwen3_5LayerStack):
        return tree
    return eqx.tree_at(lambda m: m.layers, tree, tree.layers.unstack())


def _check(which, data_axis, expert_axis, depth=2, scan=False, loss_fn=_loss):
    (value, grads, new), placed, specs, new_state, state_specs = _sharded_step(
        which, data_axis, expert_axis, depth, scan, loss_fn
    )
    value1, grads1 = _reference(which, depth)
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    # The gradients to 1e-4, as tests/test_qwen3_moe.py's training step: two float32 runs
    # summing in different orders (and the scanned layers' against the loop's).
    errors = jax.tree.map(rel_err, _unstacked(jax.device_get(grads)), grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    # The new parameters: one device's AdamW step from these gradients, to 1e-5. (Against
    # one device's own step they agree to 1e-5 too but for the odd element whose gradient
    # is within a few times Adam's `eps` of zero: its first step, g / (|g| + eps), turns
    # the gradients' 1e-5 into up to 3e-5 of the parameter.)
    params = eqx.filter(_model(which, depth, scan), eqx.is_array)
    errors = jax.tree.map(rel_err, new, _one_device_update(params, jax.device_get(grads)))
    assert max(jax.tree.leaves(errors)) <= 1e-5, errors
    # What the specs split is split, on the devices and in the gradients and moments.
    assert_split_as_specs(specs, _mesh().shape, placed, grads)
    # Adam's moments split as their parameters.
    mu = new_state[0].mu
    mu_specs = state_specs[0].mu  # pyright: ignore[reportIndexIssue, reportAttributeAccessIssue]
    assert jax.tree.structure(mu_specs) == jax.tree.structure(
        specs, is_leaf=lambda s: isinstance(s, P)
    )
    for m, x in zip(jax.tree.leaves(mu), jax.tree.leaves(placed)):
        assert _shard_shape(m) == _shard_shape(x)
    return placed


# About 20 s (one training step of the two-layer model compiled under shard_map, and one
# device's); the mixture-of-experts model below covers every kind of parameter but the
# dense MLP's.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_dense_training_step_with_fsdp():
    # Every parameter split over "dp" that divides: the embedding's vocabulary, the
    # projections' largest dimension.
    placed = _check("dense", "dp", None)
    assert _shard_shape(placed.embed.weight) == (64 // DP, 24)
    mixer = placed.layers[0].mixer
    assert _shard_shape(mixer.in_proj_qkv.weight) == (64 // DP, 24)


# About 30 s: slow. The default run trains the MoE model under FSDP with its layers scanned
# (`test_scanned_moe_training_step_with_fsdp`).
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_moe_training_step_with_fsdp_and_experts_over_both_axes():
    # The experts over ("dp", "cp"), two per device; everything else split over "dp".
    placed = _check("moe", "dp", ("dp", "cp"))
    experts = placed.layers[0].mlp.experts
    assert _shard_shape(experts.gate_proj) == (8 // (DP * CP), 8, 24)
    assert _shard_shape(placed.layers[0].mlp.gate.weight) == (8, 24 // DP)


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "which, data_axis, expert_axis",
    [
        ("moe", "dp", "cp"),  # the experts over "cp" and FSDP over "dp" on another dimension
        ("moe", ("dp", "cp"), None),  # every parameter over all four devices, experts too
        ("dense", ("dp", "cp"), None),
        ("tied", "dp", None),  # the embedding gathered twice: for the lookup and the head
    ],
)
def test_training_step_with_fsdp_grid(which, data_axis, expert_axis):
    placed = _check(which, data_axis, expert_axis)
    if which == "moe":
        shape = _shard_shape(placed.layers[0].mlp.experts.gate_proj)
        assert shape == ((8 // CP, 8, 24 // DP) if expert_axis else (8, 8, 24 // (DP * CP)))


def test_specs_follow_the_rule():
    # The largest dimension that divides, the first of equal ones; experts' first
    # dimension over their axis and FSDP on another; scalars replicated.
    params = eqx.filter(_model("moe"), eqx.is_array)
    mesh = AbstractMesh((2, 4), ("dp", "cp"))
    specs = partition_specs(params, mesh, data_axis="dp", expert_axis="cp")
    layer = specs.layers[0]
    assert specs.embed.weight == P("dp")  # (64, 24)
    assert layer.mixer.out_proj.weight == P(None, "dp")  # (24, 32)
    assert layer.mlp.shared_expert_gate.weight == P(None, "dp")  # (1, 24)
    assert layer.mlp.experts.gate_proj == P("cp", None, "dp")  # (8, 8, 24)
    assert layer.mlp.experts.down_proj == P("cp", "dp")  # (8, 24, 8)
    # Experts over an axis that FSDP also uses: not split twice.
    specs = partition_specs(params, mesh, data_axis="dp", expert_axis=("dp", "cp"))
    assert specs.layers[0].mlp.experts.gate_proj == P(("dp", "cp"))
    # Without FSDP, the experts alone: as `expert_partition_specs`.
    specs = partition_specs(params, mesh, expert_axis="cp")
    assert specs.layers[0].mlp.experts.up_proj == P("cp")
    assert specs.layers[0].mixer.A_log == P()


def test_leaves_that_do_not_divide_stay_whole_and_are_named():
    params = eqx.filter(_model("dense"), eqx.is_array)
    named = r"stay whole on every rank: .*`\.layers\[0\]\.mixer\.A_log`"
    with pytest.warns(UserWarning, match=named):
        specs = partition_specs(params, AbstractMesh((8,), ("dp",)), data_axis="dp")
    assert specs.layers[0].mixer.A_log == P()  # 4 value heads over 8 ranks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        partition_specs(params, AbstractMesh((2,), ("dp",)), data_axis="dp")


def test_bad_sharding_names_what_to_change(without_runtime_typecheck):
    params = eqx.filter(_model("moe"), eqx.is_array)
    mesh = AbstractMesh((2, 3), ("dp", "ep"))
    with pytest.raises(ValueError, match=r"`data_axis` names mesh axes \['tp'\].*\['dp', 'ep'\]"):
        partition_specs(params, mesh, data_axis="tp")
    with pytest.raises(ValueError, match=r"8 experts .* cannot be split evenly over the 3 ranks"):
        partition_specs(params, mesh, expert_axis="ep")
    with pytest.raises(TypeError, match=r"`data_axis` must be None, the name of a mesh axis"):
        partition_specs(params, mesh, data_axis=0)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`mesh` must be a `jax.sharding.Mesh`"):
        partition_specs(params, {"dp": 2}, data_axis="dp")
    dense = eqx.filter(_model("dense"), eqx.is_array)
    with pytest.raises(ValueError, match=r"no routed experts"):
        partition_specs(dense, mesh, expert_axis="dp")
    specs = partition_specs(dense, mesh, data_axis="dp")
    with pytest.raises(ValueError, match=r"enclosing `jax.shard_map` does not have"):
        gather_params(dense.layers[0], specs.layers[0], "dp")
    with pytest.raises(TypeError, match=r"`axis` must be the name of a mesh axis"):
        FSDP(["dp"], specs)  # pyright: ignore[reportArgumentType]
    mesh = _mesh()
    specs = partition_specs(dense, mesh, data_axis="dp")
    f = jax.shard_map(
        lambda p: gather_params(p.layers[0], specs.layers[1], "dp"),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=r"`specs` is not of `tree`'s structure"):
        jax.eval_shape(f, dense)


def test_apply_gathers_again_in_the_backward():
    # `FSDP.apply` keeps no gathered weight for the backward: the gradient program gathers
    # the second layer's weights again in the backward (the first one's are not needed
    # there: no gradient of the input), a plain `gather_params` keeps them.
    mesh = _mesh()
    layers = [eqx.nn.Linear(8, 8, use_bias=False, key=jr.key(i)) for i in range(2)]
    specs = partition_specs(layers, mesh, data_axis="dp")
    fsdp = FSDP("dp", specs)
    assert specs[0].weight == P("dp")

    def loss(layers, x, regather):
        def local(layers, x):
            for i, layer in enumerate(layers):
                if regather:
                    x = jax.vmap(lambda r: fsdp.apply(layer, lambda s: s[i], r))(x)
                else:
                    x = jax.vmap(fsdp.gather(layer, lambda s: s[i]))(x)
            return jax.lax.psum(jnp.sum(jnp.sin(x)), ("dp", "cp"))

        return jax.shard_map(local, mesh=mesh, in_specs=(specs, P(("dp", "cp"))), out_specs=P())(
            layers, x
        )

    x = jnp.ones((8, 8))
    for regather, gathers in ((False, 2), (True, 3)):
        text = jax.jit(jax.grad(ft.partial(loss, regather=regather))).lower(layers, x).as_text()
        assert text.count("stablehlo.all_gather") == gathers


def test_gather_params_of_a_stack_of_layers():
    # A stack of two layers (each array with a leading layer dimension, as `jax.lax.scan`
    # runs them), its specs the one layer's behind `None`: gathered whole on every rank,
    # the experts' dimension left split.
    mesh = _mesh()
    layer = _model("moe").layers[0]
    layer = (layer.mixer.out_proj, layer.mlp.experts)
    stack = jax.tree.map(lambda a: np.stack([a, np.asarray(a) + 1]), layer)
    one = partition_specs(layer, mesh, data_axis="dp", expert_axis="cp")
    specs = jax.tree.map(lambda s: P(None, *s), one, is_leaf=lambda s: isinstance(s, P))
    assert specs[0].weight == P(None, None, "dp")
    assert specs[1].gate_proj == P(None, "cp", None, "dp")

    def local(stack):
        gathered = gather_params(stack, specs, "dp")
        return jax.tree.map(lambda a: a[None], gathered)

    out_specs = jax.tree.map(
        lambda s: P("dp", None, "cp") if s[1:2] == ("cp",) else P("dp"),
        specs,
        is_leaf=lambda s: isinstance(s, P),
    )
    placed = jax.device_put(stack, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    out = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=out_specs))(placed)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(stack)):
        for rank in range(DP):
            np.testing.assert_array_equal(got[rank], want)


# About 28 s (one device's reference is the two-layer MoE test's above): the two layers
# stacked, one group, scanned.
@pytest.mark.usefixtures("fast_compile_one_test")
def test_scanned_moe_training_step_with_fsdp():
    # The two layers built with scan_layers=True: one stacked group of [linear, full]. The
    # stacked parameters split on a dimension other than the group axis, each layer
    # gathered from its group's slices inside the scan: one device's loop.
    placed = _check("moe", "dp", ("dp", "cp"), scan=True)
    period = placed.layers.period
    assert placed.layers.num_groups == 1 and len(period) == 2 and not placed.layers.rest
    assert _shard_shape(period[0].mlp.experts.gate_proj) == (1, 8 // (DP * CP), 8, 24)
    assert _shard_shape(period[1].mlp.gate.weight) == (1, 8, 24 // DP)


# 25 to 70 s each (215 s in all): five layers built with scan_layers=True, two stacked groups of
# [linear, full] and a linear layer after them, against one device's five-layer loop.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "which, data_axis, expert_axis",
    [
        ("moe", "dp", ("dp", "cp")),
        ("moe", "dp", "cp"),  # the experts over "cp", FSDP over "dp" on another dimension
        ("dense", "dp", None),
        ("dense", ("dp", "cp"), None),
        ("tied", "dp", None),
    ],
)
def test_scanned_training_step_with_fsdp_grid(which, data_axis, expert_axis):
    placed = _check(which, data_axis, expert_axis, depth=5, scan=True)
    period, rest = placed.layers.period, placed.layers.rest
    assert placed.layers.num_groups == 2 and len(period) == 2 and len(rest) == 1
    n = DP * (CP if data_axis == ("dp", "cp") else 1)
    assert _shard_shape(period[0].mixer.out_proj.weight) == (2, 24, 32 // n)
    assert _shard_shape(rest[0].mixer.out_proj.weight) == (24, 32 // n)
    if which == "moe":
        shape = _shard_shape(period[0].mlp.experts.gate_proj)
        assert shape == ((2, 2, 8, 24) if expert_axis == ("dp", "cp") else (2, 4, 8, 12))


def _spec_leaves(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda s: isinstance(s, P))


def test_specs_of_stacked_layers():
    # The stack's specs are the loop's with the group axis in front, never split (two
    # groups over a data axis of two would divide); the experts' as
    # `expert_partition_specs` puts them, FSDP on another dimension; the layer after the
    # stack, the embedding and the head as the loop's.
    mesh = AbstractMesh((2, 2), ("dp", "cp"))
    loop = eqx.filter(_model("moe", 5), eqx.is_array)
    stack = eqx.filter(_model("moe", 5, scan=True), eqx.is_array)
    for expert_axis in ("cp", None):
        kw = dict(data_axis="dp", expert_axis=expert_axis)
        want = partition_specs(loop, mesh, **kw)
        specs = partition_specs(stack, mesh, **kw)
        assert isinstance(specs.layers, Qwen3_5LayerStack)
        for i in range(5):
            stacked = i < 4
            got = _spec_leaves(specs.layers.period[i % 2] if stacked else specs.layers.rest[0])
            expected = _spec_leaves(want.layers[i])
            assert len(got) == len(expected)
            for g, w in zip(got, expected):
                assert g == (P(None, *w) if stacked and len(w) else w), (i, g, w)
        for part in (lambda m: m.embed, lambda m: m.lm_head, lambda m: m.norm):
            assert _spec_leaves(part(specs)) == _spec_leaves(part(want))
    period = partition_specs(stack, mesh, data_axis="dp", expert_axis="cp").layers.period
    assert period[0].mlp.experts.gate_proj == P(None, "cp", None, "dp")  # (2, 8, 8, 24)
    assert period[1].mixer.o_proj.weight == P(None, None, "dp")


def test_fsdp_specs_must_be_of_the_model():
    # The specs of the loop's parameters given to a model with its layers stacked, and the
    # other way round, are refused with the fix named, before any gather.
    dense = _model("dense")
    stacked = _model("dense", scan=True)
    mesh = _mesh()
    for model, other in ((stacked, dense), (dense, stacked)):
        specs = partition_specs(eqx.filter(other, eqx.is_array), mesh, data_axis="dp")
        with pytest.raises(ValueError, match=r"not of this model's structure.*partition_specs"):
            model(jnp.zeros((8,), jnp.int32), fsdp=FSDP("dp", specs))


# About 30 s on 2 busy cores (four lowerings of the two-layer model's gradient).
@pytest.mark.slow
def test_layer_remat_holds_under_fsdp():
    # `remat="layer"` keeps each layer's input only, with FSDP as without: the backward
    # recomputes the same products (a layer run through `FSDP.apply` alone would keep its
    # activations, its policy saving everything but the gathers). Lowered, not compiled.
    mesh = _mesh()
    params, static = eqx.partition(_model("dense"), eqx.is_array)
    specs = partition_specs(params, mesh, data_axis="dp")
    seq = P("dp", "cp")

    def dots(remat, fsdp):
        def local(params, inputs, targets):
            model = eqx.combine(params, static)
            kw = dict(cp=ContextParallel("cp"), fsdp=fsdp, remat=remat)
            return _loss(model, inputs, targets, ("dp", "cp"), **kw)

        in_specs = (specs if fsdp else jax.tree.map(lambda _: P(), params), seq, seq)
        loss = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())
        text = jax.jit(jax.grad(loss)).lower(params, *_batch()).as_text()
        return text.count("stablehlo.dot_general")

    fsdp = FSDP("dp", specs)
    assert dots("layer", fsdp) == dots("layer", None) > dots("none", None)

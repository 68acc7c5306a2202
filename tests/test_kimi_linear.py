"""Kimi Linear (`deltanet_cp.models.KimiLinearForCausalLM`) against transformers'
`KimiLinearForCausalLM`, and its sigmoid router against a float64 NumPy transcription of
transformers' `KimiLinearTopkRouter`.

The fixtures are tiny random transformers models (tests/data/make_kimi_linear_fixtures.py):
three layers, the first with a dense MLP and the other two sparse (8 experts in 2 groups, 1
group kept, 2 per token, renormalised and scaled by 2.446, a random `e_score_correction_bias`,
a shared expert twice an expert's width); `kimi_linear_mixed` (the default tests') has Kimi
Delta Attention in layers 0 and 2 and multi-head latent attention in layer 1,
`kimi_linear` Kimi Delta Attention in all three. Saved in the released checkpoints' layout,
with transformers' logits of 32 tokens and its 16 greedy tokens after them.
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
from safetensors.numpy import load_file

from deltanet_cp import ContextParallel, Contiguous, Zigzag
from deltanet_cp.models import KimiLinearConfig, KimiLinearForCausalLM
from deltanet_cp.nn import (
    expert_partition_specs,
    KimiDeltaAttention,
    MultiHeadLatentAttention,
    SigmoidTopKRouter,
    SparseMoE,
    SwiGLU,
)

from .helpers import rel_err


DATA = pathlib.Path(__file__).parent / "data"
MIXED = "kimi_linear_mixed"
FOLDER = DATA / MIXED
CHUNK = 4  # the delta rule's chunk: the 32 fixture tokens are eight chunks
T = 32
KDA, MLA = KimiDeltaAttention, MultiHeadLatentAttention
MIXERS = {"kimi_linear_mixed": [KDA, MLA, KDA], "kimi_linear": [KDA, KDA, KDA]}


@ft.cache
def _io(name: str = MIXED) -> dict[str, np.ndarray]:
    return load_file(DATA / name / "io.safetensors")


@ft.cache
def _model(name: str = MIXED, scan_layers: bool = False) -> KimiLinearForCausalLM:
    return KimiLinearForCausalLM.from_pretrained(
        DATA / name, chunk_size=CHUNK, scan_layers=scan_layers
    )


def _tokens(name: str = MIXED) -> jax.Array:
    return jnp.asarray(_io(name)["tokens"])


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@ft.cache
def _outputs(name: str = MIXED):
    return eqx.filter_jit(lambda m, t: m.logits_and_router_stats(t))(_model(name), _tokens(name))


@pytest.mark.parametrize("name", [MIXED, pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_logits_match_transformers(name):
    model = _model(name)
    assert [type(layer.mixer) for layer in model.layers] == MIXERS[name]
    assert [type(layer.mlp) for layer in model.layers] == [SwiGLU, SparseMoE, SparseMoE]
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.gate, SigmoidTopKRouter)
    router = moe.gate
    assert router.weight.dtype == jnp.float32
    assert (router.n_group, router.topk_group, router.routed_scaling_factor) == (2, 1, 2.446)
    logits, stats = _outputs(name)
    ref = _io(name)["logits"]
    assert _max_abs(logits, ref) <= 1e-4 * np.abs(ref).max()
    # Two sparse layers, 32 tokens, 2 experts each; the probabilities sum to one per token.
    assert float(stats.tokens) == 2 * T and float(stats.counts.sum()) == 2 * T * 2
    assert abs(float(stats.probabilities.sum()) - 2 * T) <= 1e-4


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("name", [MIXED, pytest.param("kimi_linear", marks=pytest.mark.slow)])
def test_greedy_generation_matches_transformers(name):
    # The mixed model's: transformers' `generate` (its cache); the KDA-only model's: greedy
    # full forwards (transformers cannot make a cache without an attention layer).
    out = _model(name).generate(_tokens(name), 16)
    np.testing.assert_array_equal(out, _io(name)["generated"])


# About 13 s (prefill and decode_step compiled on their own): slow; the default run's greedy
# generation runs prefill and decode_step against transformers' generate.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_prefill_then_decode_equals_forward():
    # Positions 0..27 from a prefill, 28..31 one token at a time: the forward's logits.
    model, tokens = _model(), _tokens()
    logits, cache = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=T))(model, tokens[:28])
    rows = []
    for token in tokens[28:]:
        step, cache = model.decode_step(token, cache)
        rows.append(step)
    full, _ = _outputs()
    assert rel_err(jnp.concatenate([logits, jnp.stack(rows)]), full) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kimi_linear", MIXED])
def test_scanned_layers_match_the_loop(name):
    # The scan over the layers (no two alike here: one group of three): the loop's logits,
    # bit for bit with KDA layers only; to rounding (1 ulp seen) with the latent attention
    # layer in the scan's body, which XLA compiles otherwise than the loop's.
    logits, stats = eqx.filter_jit(lambda m, t: m.logits_and_router_stats(t))(
        _model(name, scan_layers=True), _tokens(name)
    )
    want_logits, want_stats = _outputs(name)
    if name == "kimi_linear":
        assert eqx.tree_equal((logits, stats), (want_logits, want_stats))
    else:
        assert rel_err(logits, want_logits) <= 1e-6
        np.testing.assert_array_equal(stats.counts, want_stats.counts)


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


def _names(folder: pathlib.Path) -> list[str]:
    return sorted(load_file(folder / "model.safetensors"))


def test_save_pretrained_round_trip(tmp_path):
    # The released checkpoints' names (transformers' own save_pretrained's, but the dense MLP
    # under `mlp.`, as Moonshot's checkpoints hold it), read back bit-identically; and the
    # fused layout (transformers' module names for the sparse blocks) too.
    model = _model()
    model.save_pretrained(tmp_path / "released")
    ours = _names(tmp_path / "released")
    theirs = [n.replace("layers.0.block_sparse_moe.", "layers.0.mlp.") for n in _names(FOLDER)]
    assert ours == sorted(theirs)
    config = json.loads((tmp_path / "released" / "config.json").read_text())
    assert config["architectures"] == ["KimiLinearForCausalLM"]
    assert KimiLinearConfig.from_hf(config) == model.config
    load = ft.partial(KimiLinearForCausalLM.from_pretrained, chunk_size=CHUNK)
    assert eqx.tree_equal(load(tmp_path / "released"), model)
    model.save_pretrained(tmp_path / "fused", experts="fused")
    names = _names(tmp_path / "fused")
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert eqx.tree_equal(load(tmp_path / "fused"), model)


def test_bfloat16_keeps_the_router_float32():
    model = KimiLinearForCausalLM.from_pretrained(FOLDER, dtype=jnp.bfloat16)
    moe = model.layers[1].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.gate, SigmoidTopKRouter)
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == jnp.float32
    assert moe.experts.gate_proj.dtype == jnp.bfloat16


def test_moonshot_config():
    # Moonshot's config.json: the KDA sizes and the layer pattern (1-based) in
    # `linear_attn_config`, the dense layers as `first_k_dense_replace`, its names for the
    # routing fields.
    ours = KimiLinearConfig.from_json(FOLDER)
    moonshot = {
        "model_type": "kimi_linear",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_shared_experts": 2,
        "num_expert_group": 2,
        "topk_group": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.446,
        "first_k_dense_replace": 1,
        "mla_use_nope": True,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "linear_attn_config": {
            "head_dim": 8,
            "num_heads": 2,
            "short_conv_kernel_size": 4,
            "kda_layers": [1, 3],
            "full_attn_layers": [2],
        },
    }
    assert KimiLinearConfig.from_hf(moonshot) == ours
    with pytest.raises(ValueError, match="sigmoid router"):
        KimiLinearConfig.from_hf(moonshot | {"moe_router_activation_func": "softmax"})
    with pytest.raises(ValueError, match="Qwen3NextConfig"):
        KimiLinearConfig.from_hf({"model_type": "qwen3_next"})
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        KimiLinearConfig.from_hf(moonshot | {"tie_word_embeddings": True})


# ---------------------------------------------------------------------------------------
# The sigmoid grouped router
# ---------------------------------------------------------------------------------------


def _transformers_router(x, weight, bias, top_k, n_group, topk_group, norm, scale):
    """transformers' `KimiLinearTopkRouter.forward`, line by line in float64 NumPy:
    `(topk_weights, topk_indices)` (the ids in no particular order, as `sorted=False`)."""
    logits = x @ weight.T
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + bias
    t, e = choice.shape
    group_scores = np.sort(choice.reshape(t, n_group, e // n_group), axis=-1)[..., -2:].sum(-1)
    group_idx = np.argsort(-group_scores, axis=-1, kind="stable")[:, :topk_group]
    group_mask = np.zeros_like(group_scores)
    np.put_along_axis(group_mask, group_idx, 1, axis=1)
    score_mask = np.repeat(group_mask, e // n_group, axis=-1)
    choice = np.where(score_mask.astype(bool), choice, -np.inf)
    idx = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(scores, idx, axis=1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * scale, idx


@pytest.mark.parametrize(
    "n_group, topk_group, top_k, norm", [(4, 2, 3, True), (1, 1, 2, False), (4, 3, 4, True)]
)
def test_sigmoid_router_against_transformers(n_group, topk_group, top_k, norm, getkey):
    router = SigmoidTopKRouter(
        16,
        16,
        top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
        key=getkey(),
    )
    router = eqx.tree_at(
        lambda r: (r.weight, r.e_score_correction_bias),
        router,
        (2 * router.weight, 0.2 * jr.normal(getkey(), (16,))),
    )
    x = jr.normal(getkey(), (40, 16))
    scores, experts, weights = router(x)
    ref_w, ref_idx = _transformers_router(
        np.asarray(x, np.float64),
        np.asarray(router.weight, np.float64),
        np.asarray(router.e_score_correction_bias, np.float64),
        top_k,
        n_group,
        topk_group,
        norm,
        2.5,
    )
    np.testing.assert_array_equal(np.sort(experts, -1), np.sort(ref_idx, -1))
    order, ref_order = np.argsort(experts, -1), np.argsort(ref_idx, -1)
    got = np.take_along_axis(np.asarray(weights, np.float64), order, -1)
    want = np.take_along_axis(ref_w, ref_order, -1)
    assert np.max(np.abs(got - want)) <= 1e-6
    # The bias steers the choice, not the weights: some token's choice differs without it.
    unbiased = eqx.tree_at(lambda r: r.e_score_correction_bias, router, jnp.zeros(16))
    assert not np.array_equal(np.sort(unbiased(x)[1], -1), np.sort(experts, -1))
    # And it gets no gradient.
    grads = jax.grad(lambda r: jnp.sum(r(x)[2] ** 2))(router)
    assert not np.any(grads.e_score_correction_bias) and np.any(grads.weight)


def test_router_grouping_errors(getkey):
    with pytest.raises(ValueError, match="`n_group`"):
        SigmoidTopKRouter(8, 8, 2, n_group=3, key=getkey())
    with pytest.raises(ValueError, match="`topk_group`"):
        SigmoidTopKRouter(8, 8, 5, n_group=4, topk_group=2, key=getkey())
    with pytest.raises(ValueError, match="sigmoid router"):
        SparseMoE(8, 8, 2, 4, 4, n_group=2, key=getkey())


# ---------------------------------------------------------------------------------------
# Context parallelism and training with the experts split
# ---------------------------------------------------------------------------------------

DP = 2
RATE = 0.1


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "cp, layout, kv_schedule", [(4, Zigzag(), "allgather"), (2, Contiguous(), "ring")]
)
def test_logits_context_parallel(cp, layout, kv_schedule):
    # The KDA layers' states and the latent attention's latents cross the ranks.
    model, tokens, io = _model(), _tokens(), _io()
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(model, eqx.is_array)
    context = ContextParallel("cp", layout=layout)

    def local(params, tokens):
        return eqx.combine(params, static)(tokens, cp=context, kv_schedule=kv_schedule)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp")), out_specs=P("cp"))
    shard = jax.device_put(layout.to_layout(tokens, cp, axis=0), NamedSharding(mesh, P("cp")))
    logits = layout.from_layout(jax.jit(f)(params, shard), cp, axis=0)
    assert _max_abs(logits, io["logits"]) <= 1e-4 * np.abs(io["logits"]).max()


@ft.cache
def _batch():
    tokens = np.random.default_rng(0).integers(0, 64, (DP, T + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _loss(model, inputs, targets, cp=None, expert_axis=None, axes=()):
    logits = jax.vmap(lambda t: model(t, cp=cp, expert_axis=expert_axis))(inputs)
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    count = jnp.asarray(targets.size, jnp.float32)
    if axes:
        nll, count = jax.lax.psum((nll, count), axes)
    return nll / count, logits


@ft.cache
def _reference():
    params, static = eqx.partition(_model(), eqx.is_array)
    fn = lambda p, i, t: _loss(eqx.combine(p, static), i, t)  # noqa: E731
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params, *_batch())


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "cp, layout, axis",
    [
        # About 16 s each (a training step of the three-layer model compiled under
        # shard_map): the slow suite's.
        pytest.param(2, Zigzag(), ("dp", "cp"), marks=pytest.mark.slow),
        pytest.param(4, Zigzag(), "cp", marks=pytest.mark.slow),
        pytest.param(4, Contiguous(), ("dp", "cp"), marks=pytest.mark.slow),
    ],
)
def test_training_step_with_experts_split(cp, layout, axis):
    # The batch over "dp", time over "cp", the routed experts split over `axis`: the loss,
    # the logits, every gradient and the parameters after an optax step equal one device's.
    import optax

    params, static = eqx.partition(_model(), eqx.is_array)
    mesh = jax.make_mesh(
        (DP, cp), ("dp", "cp"), devices=jax.devices()[: DP * cp], axis_types=(AxisType.Auto,) * 2
    )
    specs = expert_partition_specs(params, axis)
    seq = P("dp", "cp")
    context = ContextParallel("cp", layout=layout)

    def local(params, inputs, targets):
        return _loss(eqx.combine(params, static), inputs, targets, context, axis, ("dp", "cp"))

    def loss(params, inputs, targets):
        inputs, targets = layout.to_layout(inputs, cp), layout.to_layout(targets, cp)
        value, logits = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=(P(), seq)
        )(params, inputs, targets)
        return value, layout.from_layout(logits, cp)

    optimizer = optax.sgd(RATE)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, logits, grads, optax.apply_updates(params, updates)

    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    experts = params.layers[1].mlp.experts.gate_proj
    ranks = DP * cp if isinstance(axis, tuple) else cp
    assert experts.sharding.shard_shape(experts.shape)[0] == 8 // ranks
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        value, logits, grads, new = step(params, optimizer.init(params), *_batch())
    (value1, logits1), grads1 = _reference()
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    assert rel_err(logits, logits1) <= 1e-5
    errors = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    expected = jax.tree.map(lambda p, g: p - RATE * g, params, grads1)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, new, expected))) <= 1e-5

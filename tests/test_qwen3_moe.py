"""The mixture-of-experts models, Qwen3-Next and Qwen3.5 MoE: transformers' logits, greedy tokens
and load-balancing loss from their checkpoints (both expert layouts, one file and sharded, the
multimodal wrapper's names), prefill and decoding against the full forward; the MoE layer
against a dense float64 reference; and the errors of bad inputs.

The fixtures are tiny random transformers models (tests/data/make_qwen3_moe_fixtures.py):
`qwen3_next_moe` (per-expert tensors, layer types [linear, full, linear, full], layer 1 dense
through `mlp_only_layers`, `norm_topk_prob=False`) and `qwen3_5_moe` (fused experts, five
shards, [linear, linear, linear, full], every layer sparse).
"""

import functools as ft
import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from deltanet_cp import ContextParallel, Contiguous, Zigzag
from deltanet_cp.models import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from deltanet_cp.nn import (
    expert_partition_specs,
    load_balancing_loss,
    SparseMoE,
    SwiGLU,
    SwiGLUExperts,
)

from .helpers import pairwise, rel_err


DATA = pathlib.Path(__file__).parent / "data"
IO = load_file(DATA / "qwen3_moe_io.safetensors")
MODELS = {
    "next": (Qwen3NextForCausalLM, "qwen3_next_moe"),
    "moe": (Qwen3_5MoeForCausalLM, "qwen3_5_moe"),
}
CHUNK = 4  # the Gated DeltaNet chunk size: the 12 fixture tokens are three chunks


@ft.cache
def _model(which: str):
    cls, folder = MODELS[which]
    return cls.from_pretrained(DATA / folder, chunk_size=CHUNK)


def _tokens(which: str) -> jax.Array:
    return jnp.asarray(IO[f"{which}_tokens"])


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@eqx.filter_jit
def _forward(model, tokens):
    return model.logits_and_router_stats(tokens)


@ft.cache
def _outputs(which: str):
    return _forward(_model(which), _tokens(which))


def _tensors(folder: pathlib.Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _rewrite(tmp_path, which: str, change) -> pathlib.Path:
    """The fixture `which` rewritten into one file: `change(tensors, config)` edits both."""
    folder = DATA / MODELS[which][1]
    tensors = _tensors(folder)
    config = json.loads((folder / "config.json").read_text())
    tensors, config = change(dict(tensors), config)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _fuse_experts(tensors, config):
    """Per-expert tensors as the fused layout (`gate_up_proj`, gate rows first)."""
    e = config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue
        stack = {
            f: np.stack([tensors.pop(f"{p}{j}.{f}.weight") for j in range(e)])
            for f in ("gate_proj", "up_proj", "down_proj")
        }
        tensors[p + "gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], 1)
        tensors[p + "down_proj"] = stack["down_proj"]
    return tensors, config


def _split_experts(tensors, config):
    """Fused experts as one tensor per expert."""
    inter = config["moe_intermediate_size"]
    for name in [n for n in tensors if n.endswith("mlp.experts.gate_up_proj")]:
        p = name[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(p + "down_proj")
        for j in range(gate_up.shape[0]):
            tensors[f"{p}{j}.gate_proj.weight"] = gate_up[j, :inter]
            tensors[f"{p}{j}.up_proj.weight"] = gate_up[j, inter:]
            tensors[f"{p}{j}.down_proj.weight"] = down[j]
    return tensors, config


# ---------------------------------------------------------------------------------------
# Parity with transformers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", list(MODELS))
def test_logits_and_aux_loss_match_transformers(which):
    model = _model(which)
    kinds = [type(layer.mlp) for layer in model.layers]
    if which == "next":
        assert kinds == [SparseMoE, SwiGLU, SparseMoE, SparseMoE]  # layer 1: mlp_only_layers
        assert model.config.norm_topk_prob is False
    else:
        assert kinds == [SparseMoE] * 4
    logits, stats = _outputs(which)
    ref = IO[f"{which}_logits"]
    assert _max_abs(logits, ref) <= 1e-4 * np.abs(ref).max()
    # transformers' load-balancing loss over all sparse layers' tokens (softmax once).
    loss = load_balancing_loss(stats)
    assert abs(float(loss) - float(IO[f"{which}_aux_loss"])) <= 1e-5
    sparse = sum(k is SparseMoE for k in kinds)
    assert float(stats.tokens) == sparse * 12 and float(stats.counts.sum()) == sparse * 12 * 2


# About 13 s (the scanned forward compiled); the default run has the scanned dense model
# against transformers (tests/test_qwen3_5.py).
@pytest.mark.slow
def test_scanned_layers_match_transformers():
    # Qwen3-Next's layers stacked and scanned (one group of four: mlp_only_layers makes
    # layer 1 dense): transformers' logits and load-balancing loss, the loop's bit for bit.
    model = Qwen3NextForCausalLM.from_pretrained(
        DATA / "qwen3_next_moe", chunk_size=CHUNK, scan_layers=True
    )
    logits, stats = _forward(model, _tokens("next"))
    ref = IO["next_logits"]
    assert _max_abs(logits, ref) <= 1e-4 * np.abs(ref).max()
    assert abs(float(load_balancing_loss(stats)) - float(IO["next_aux_loss"])) <= 1e-5
    assert eqx.tree_equal((logits, stats), _outputs("next"))


@pytest.mark.parametrize("which", list(MODELS))
def test_greedy_generation_matches_transformers(which):
    out = _model(which).generate(_tokens(which)[:8], 5)
    np.testing.assert_array_equal(out, IO[f"{which}_generated"])


@pytest.mark.slow
@pytest.mark.parametrize("which", list(MODELS))
def test_prefill_then_decode_equals_forward(which):
    # Positions 0..7 from a prefill, 8..11 one token at a time: the forward's logits, and
    # transformers' own cached decoding. Slow (about 16 s a model to compile); the default
    # suite's greedy-generation test runs prefill and decode_step against transformers.
    model, tokens = _model(which), _tokens(which)
    logits, cache = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=12))(model, tokens[:8])
    rows = []
    for token in tokens[8:]:
        step, cache = model.decode_step(token, cache)
        rows.append(step)
    full, _ = _outputs(which)
    assert rel_err(jnp.concatenate([logits, jnp.stack(rows)]), full) <= 1e-5
    assert _max_abs(jnp.stack(rows), IO[f"{which}_decode_logits"]) <= 1e-4


# ---------------------------------------------------------------------------------------
# Checkpoint layouts
# ---------------------------------------------------------------------------------------


def test_qwen3_next_fused_experts(tmp_path):
    # The fused layout (what `save_pretrained(..., save_original_format=False)` writes), one
    # file, and multi-token-prediction weights, skipped.
    def change(tensors, config):
        tensors, config = _fuse_experts(tensors, config)
        tensors["mtp.fc.weight"] = np.ones((2, 2), np.float32)
        return tensors, config

    path = _rewrite(tmp_path, "next", change)
    assert eqx.tree_equal(
        Qwen3NextForCausalLM.from_pretrained(path, chunk_size=CHUNK), _model("next")
    )


def test_qwen3_5_moe_per_expert_multimodal_names(tmp_path):
    # One tensor per expert, under the multimodal wrapper's names and config (`text_config`),
    # with a vision tower and MTP weights to skip.
    def change(tensors, config):
        tensors, config = _split_experts(tensors, config)
        tensors = {n.replace("model.", "model.language_model.", 1): x for n, x in tensors.items()}
        tensors["model.visual.patch.weight"] = np.ones(3, np.float32)
        tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = np.ones((2, 2, 2), np.float32)
        return tensors, {"model_type": "qwen3_5_moe", "text_config": config}

    path = _rewrite(tmp_path, "moe", change)
    assert eqx.tree_equal(
        Qwen3_5MoeForCausalLM.from_pretrained(path, chunk_size=CHUNK), _model("moe")
    )


# ---------------------------------------------------------------------------------------
# The MoE layer against a dense reference; training
# ---------------------------------------------------------------------------------------


def _dense_reference(moe: SparseMoE, x: np.ndarray) -> np.ndarray:
    """Every expert on every token in float64, masked by the top-k weights (computed here
    too: softmax, top-k, renormalised), plus the gated shared expert."""
    w = np.asarray(moe.gate.weight, np.float64)
    logits = x @ w.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, : moe.top_k]
    weights = np.zeros_like(p)
    np.put_along_axis(weights, top, np.take_along_axis(p, top, -1), -1)
    if moe.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    g, u, d = (
        np.asarray(a, np.float64)
        for a in (moe.experts.gate_proj, moe.experts.up_proj, moe.experts.down_proj)
    )
    hg, hu = np.einsum("th,eih->tei", x, g), np.einsum("th,eih->tei", x, u)
    routed = np.einsum("tei,ehi,te->th", hg / (1 + np.exp(-hg)) * hu, d, weights)
    s = moe.shared_expert
    sg, su = (
        x @ np.asarray(s.gate_proj.weight, np.float64).T,
        x @ np.asarray(s.up_proj.weight, np.float64).T,
    )
    shared = (sg / (1 + np.exp(-sg)) * su) @ np.asarray(s.down_proj.weight, np.float64).T
    assert moe.shared_expert_gate is not None  # Qwen's shared expert is gated
    gate = 1 / (1 + np.exp(-(x @ np.asarray(moe.shared_expert_gate.weight, np.float64).T)))
    return routed + gate * shared


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_layer_against_dense_reference(norm_topk_prob, getkey):
    moe = SparseMoE(16, 6, 3, 8, 5, norm_topk_prob=norm_topk_prob, key=getkey())
    x = jr.normal(getkey(), (20, 16))
    y, stats = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    ref = _dense_reference(moe, np.asarray(x, np.float64))
    assert _max_abs(y, ref) <= 1e-5 * np.abs(ref).max()
    # The load-balancing loss from the same routing, in numpy.
    xs = np.asarray(x, np.float64)
    logits = xs @ np.asarray(moe.gate.weight, np.float64).T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    chosen = np.argsort(-p, -1)[:, :3]
    f = np.bincount(chosen.ravel(), minlength=6) / 20
    want = 6 * np.sum(f * p.mean(0))
    assert abs(float(load_balancing_loss(stats)) - want) <= 1e-5 * want


def _transformers_aux_loss(router_logits, num_experts, top_k, attention_mask):
    """transformers' `load_balancing_loss_func` with an `attention_mask`, in float64 NumPy:
    `router_logits` `(layers, batch * seq, E)`, `attention_mask` `(batch, seq)` of 0/1."""
    layers = router_logits.shape[0]
    logits = router_logits.reshape(-1, num_experts)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    selected = np.argsort(-p, -1, kind="stable")[:, :top_k]
    expert_mask = np.eye(num_experts)[selected]  # (layers * batch * seq, top_k, E)
    mask = np.broadcast_to(attention_mask[None], (layers, *attention_mask.shape)).reshape(-1)
    tokens_per_expert = np.sum(expert_mask * mask[:, None, None], 0) / mask.sum()
    router_prob_per_expert = np.sum(p * mask[:, None], 0) / mask.sum()
    return num_experts * np.sum(tokens_per_expert * router_prob_per_expert[None])


@pytest.mark.usefixtures("fast_compile_one_test")
def test_router_stats_count_the_masked_tokens_as_transformers(getkey):
    # Two sparse layers over a batch of two rows with padding at their ends: the stats with
    # `token_mask` (summed over rows and layers) give transformers' masked loss; with every
    # token in the mask, its unmasked one, bit for bit the stats without a mask.
    layers = [SparseMoE(16, 6, 2, 8, 5, key=getkey()) for _ in range(2)]
    x = jr.normal(getkey(), (2, 2, 10, 16))  # (layers, batch, seq, hidden)
    mask = np.ones((2, 10), bool)
    mask[0, 7:] = mask[1, 4:] = False

    @jax.jit
    def stats(layers, x, mask):
        def summed(mask):
            per = [
                jax.vmap(lambda x: moe(x)[1])(xl)
                if mask is None
                else jax.vmap(lambda x, m: moe(x, token_mask=m)[1])(xl, mask)
                for moe, xl in zip(layers, x)
            ]
            return jax.tree.map(lambda *a: sum(jnp.sum(b, 0) for b in a), *per)

        return summed(mask), summed(jnp.ones_like(mask)), summed(None)

    logits = np.stack(
        [
            np.asarray(xl, np.float64).reshape(-1, 16) @ np.asarray(m.gate.weight, np.float64).T
            for m, xl in zip(layers, x)
        ]
    )
    masked, everything, unmasked = stats(layers, x, jnp.asarray(mask))
    assert float(masked.tokens) == 2 * mask.sum()
    want = _transformers_aux_loss(logits, 6, 2, mask.astype(np.float64))
    assert abs(float(load_balancing_loss(masked)) - want) <= 1e-5 * want
    want_full = _transformers_aux_loss(logits, 6, 2, np.ones((2, 10)))
    assert abs(float(load_balancing_loss(unmasked)) - want_full) <= 1e-5 * want_full
    assert abs(want - want_full) > 1e-3 * want  # the padding does move the loss
    for a, b in zip(jax.tree.leaves(everything), jax.tree.leaves(unmasked)):
        np.testing.assert_array_equal(a, b)


def test_token_mask_errors(getkey, without_runtime_typecheck):
    moe = SparseMoE(16, 6, 2, 8, 5, key=getkey())
    x = jnp.zeros((10, 16))
    with pytest.raises(ValueError, match="`token_mask` must be a boolean array"):
        moe(x, token_mask=jnp.ones(10, jnp.int32))
    with pytest.raises(ValueError, match=r"seq = 10.*got bool \(9,\)"):
        moe(x, token_mask=jnp.ones(9, bool))


@pytest.mark.usefixtures("fast_compile_one_test")
def test_moe_gradients_flow_to_router_and_experts(getkey):
    # Gradients through the grouped matmuls and the routing weights (the choice of experts
    # is not differentiated): equal to those of the dense masked computation in JAX.
    moe = SparseMoE(8, 4, 2, 6, 4, key=getkey())
    x = jr.normal(getkey(), (10, 8))

    def dense(m, x):
        probs, experts, weights = m.route(x)
        w = jnp.zeros(probs.shape).at[jnp.arange(10)[:, None], experts].set(weights)
        e = m.experts
        h = jax.nn.silu(jnp.einsum("th,eih->tei", x, e.gate_proj)) * jnp.einsum(
            "th,eih->tei", x, e.up_proj
        )
        routed = jnp.einsum("tei,ehi,te->th", h, e.down_proj, w)
        shared = jax.vmap(m.shared_expert)(x) * jax.nn.sigmoid(x @ m.shared_expert_gate.weight.T)
        return jnp.sum(jnp.sin(routed + shared))

    def sparse(m, x):
        return jnp.sum(jnp.sin(m(x)[0]))

    got = eqx.filter_jit(eqx.filter_grad(sparse))(moe, x)
    want = eqx.filter_jit(eqx.filter_grad(dense))(moe, x)
    errors = jax.tree.leaves(jax.tree.map(rel_err, got, want))
    assert max(errors) <= 1e-5, errors
    assert float(jnp.abs(got.gate.weight).sum()) > 0


# ---------------------------------------------------------------------------------------
# The MoE layer: dtypes, non-finite tokens, empty sequences, ties
# ---------------------------------------------------------------------------------------

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
# The relative error of a layer computed in float32 and rounded to the narrower dtype of the
# pair (a few of its ulps: bfloat16 has 8 bits, float16 11).
_DTYPE_FAST = {("bf16", "f32"), ("f32", "f16"), ("f16", "bf16")}
DTYPE_TOL = {jnp.bfloat16: 3e-2, jnp.float16: 4e-3, jnp.float32: 1e-5}


def _cast(tree, dtype):
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


@ft.cache
def _dtype_call():
    """One jitted forward and gradient (recompiled per dtype pair, not per test)."""

    def loss(m, x):
        y, _ = m(x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

    return eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))


@pytest.mark.parametrize(
    "tokens, params",
    [
        # Default run: each dtype once as tokens and once as parameters, in pairs that differ.
        pytest.param(t, p, marks=() if (t, p) in _DTYPE_FAST else pytest.mark.slow)
        for p in DTYPES
        for t in DTYPES
    ],
)
def test_moe_computes_in_the_parameters_dtype(tokens, params, getkey):
    # Every pair of token and parameter dtypes (wider experts than tokens used to raise
    # `lax.dynamic_update_slice requires arguments to have the same dtypes`): the output in
    # the tokens' dtype, near the float64 reference of the same (rounded) numbers, and
    # gradients in the parameters' dtypes.
    xd, pd = DTYPES[tokens], DTYPES[params]
    moe = _cast(SparseMoE(8, 4, 2, 6, 4, key=getkey()), pd)
    x = jr.normal(getkey(), (10, 8)).astype(xd)
    (_, y), grads = _dtype_call()(moe, x)
    assert y.dtype == xd and y.shape == x.shape
    ref = _dense_reference(moe, np.asarray(x, np.float64))
    narrow = min(xd, pd, key=lambda d: jnp.finfo(d).nmant)  # the coarser of the two
    assert rel_err(y, ref) <= DTYPE_TOL[narrow], (tokens, params, rel_err(y, ref))
    leaves = jax.tree.leaves(grads)
    assert all(g.dtype == pd and bool(jnp.all(jnp.isfinite(g))) for g in leaves)


def test_moe_under_x64_mixes_float64_and_float32(getkey):
    # float64 parameters with float32 tokens and the reverse (one raised), and float64
    # throughout: accumulated in float64 (float32 sums were 6.5e-8 from the reference).
    moe = SparseMoE(8, 4, 2, 6, 4, key=getkey())
    x = jr.normal(getkey(), (10, 8))
    with jax.enable_x64(True):
        call = eqx.filter_jit(lambda m, x: m(x)[0])
        for xd, pd in [(jnp.float32, jnp.float64), (jnp.float64, jnp.float32)]:
            m = _cast(moe, pd)
            y = call(m, x.astype(xd))
            assert y.dtype == xd
            ref = _dense_reference(m, np.asarray(x.astype(xd), np.float64))
            assert rel_err(y, ref) <= 1e-6
        m = _cast(moe, jnp.float64)
        x64 = x.astype(jnp.float64)
        y = call(m, x64)
        assert y.dtype == jnp.float64
        assert rel_err(y, _dense_reference(m, np.asarray(x64))) <= 1e-13


def test_model_with_float32_experts_and_float16_other_weights(getkey):
    # What a checkpoint with float32 experts and float16 other tensors loads as: every call
    # used to raise. A one-layer model: its logits are float16, near the float32 model's.
    fields = json.loads((DATA / "qwen3_5_moe" / "config.json").read_text())
    fields.update(num_hidden_layers=1, layer_types=["full_attention"])
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeConfig.from_hf(fields), key=getkey())
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    mixed = eqx.tree_at(lambda m: m.layers[0].mlp.experts, _cast(model, jnp.float16), moe.experts)
    tokens = jnp.arange(6) * 7 % fields["vocab_size"]
    logits = eqx.filter_jit(lambda m, t: m(t))(mixed, tokens)
    assert logits.dtype == jnp.float16
    assert rel_err(logits, eqx.filter_jit(lambda m, t: m(t))(model, tokens)) <= 1e-2


def _per_token_reference(experts: SwiGLUExperts, x, ids, weights, mask):
    """The experts' gradients (weights, tokens, routing weights) of the masked loss, from a
    loop over tokens in float64: each token through its own experts, nothing shared."""
    g, u, d = (
        np.asarray(a, np.float64) for a in (experts.gate_proj, experts.up_proj, experts.down_proj)
    )
    args = (g, u, d, np.asarray(x, np.float64), np.asarray(weights, np.float64))

    def loss(g, u, d, x, w):
        total = jnp.zeros((), jnp.float64)
        for t in range(x.shape[0]):
            y = jnp.zeros(x.shape[1], jnp.float64)
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                h = jax.nn.silu(g[e] @ x[t]) * (u[e] @ x[t])
                y = y + w[t, j] * (d[e] @ h)
            total = total + jnp.sum(jnp.sin(jnp.where(mask[t], y, 0)))
        return total

    with jax.enable_x64(True):
        return [np.asarray(a) for a in jax.jit(jax.grad(loss, argnums=range(5)))(*args)]


def test_masked_overflowing_token_leaks_to_no_expert(getkey):
    # Token 0's activations overflow float32 (its row times 1e20: `silu(a) * b` is inf) and
    # it is masked out of the loss. Expert 1's last tile reads expert 2's first rows, token
    # 0's: its `down_proj` gradient was NaN (0 x inf), though token 0 goes to experts 2, 3.
    experts = SwiGLUExperts(4, 8, 6, key=getkey())
    ids = np.asarray(
        [[2, 3], [1, 0], [1, 3], [0, 2], [0, 3], [2, 0], [3, 0], [0, 2], [3, 2], [0, 3]], np.int32
    )
    x = jr.normal(getkey(), (10, 8)).at[0].multiply(1e20)
    weights = jax.nn.softmax(jr.normal(getkey(), (10, 2)))
    mask = np.arange(10) != 0
    names = ["gate_proj", "up_proj", "down_proj", "x", "weights"]

    def grads(where_before):
        # The mask before the loss's nonlinearity gives token 0 a zero cotangent; after it,
        # `0 * cos(NaN)`, a NaN one (as a masked cross-entropy of a NaN logit gives).
        def loss(experts, x, weights):
            y = experts(x, jnp.asarray(ids), weights)
            if where_before:
                return jnp.sum(jnp.sin(jnp.where(mask[:, None], y, 0)))
            return jnp.sum(jnp.where(mask[:, None], jnp.sin(y), 0))

        g, dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(experts, x, weights)
        return [g.gate_proj, g.up_proj, g.down_proj, dx, dw]

    # A zero cotangent: token 0 adds exact zeros everywhere, so every gradient is finite
    # and equals a float64 loop over tokens (where nothing overflows).
    want = _per_token_reference(experts, x, ids, weights, mask)
    for name, a, b in zip(names, grads(True), want):
        assert bool(jnp.all(jnp.isfinite(a))), name
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
    # A NaN cotangent: NaN reaches token 0's experts, as autodiff's would, and no other.
    for name, a, b in zip(names[:3], grads(False)[:3], want[:3]):
        assert bool(jnp.all(jnp.isfinite(a[:2]))), name
        assert rel_err(a[:2], b[:2]) <= 1e-5, (name, rel_err(a[:2], b[:2]))


def test_moe_on_an_empty_sequence(getkey):
    moe = SparseMoE(8, 4, 2, 6, 4, key=getkey())
    y, stats = moe(jnp.zeros((0, 8)))
    assert y.shape == (0, 8) and y.dtype == jnp.float32
    assert float(stats.tokens) == 0 and float(jnp.sum(stats.counts)) == 0
    assert moe.experts(
        jnp.zeros((0, 8)), jnp.zeros((0, 2), jnp.int32), jnp.zeros((0, 2))
    ).shape == (
        0,
        8,
    )


def test_router_ties_choose_the_lower_expert(getkey):
    # The documented rule (`jax.lax.top_k`'s): equal probabilities go to the lower id.
    moe = SparseMoE(8, 6, 3, 4, 4, key=getkey())
    moe = eqx.tree_at(lambda m: m.gate.weight, moe, jnp.zeros((6, 8)).at[4].set(1.0))
    x = jnp.ones((2, 8)).at[1].set(-1.0)
    _, experts, weights = moe.route(x)
    # Token 0: expert 4 first, then the tie among the others in id order; token 1: expert 4
    # last of all, so the first three ids.
    np.testing.assert_array_equal(experts, [[4, 0, 1], [0, 1, 2]])
    np.testing.assert_allclose(weights[1], [1 / 3] * 3, rtol=1e-6)


# ---------------------------------------------------------------------------------------
# Context x expert parallelism: an optax training step
# ---------------------------------------------------------------------------------------

DP = 2  # the batch over "dp", one sequence per rank
EP_TOKENS = 32  # per sequence: 8 per rank at cp = 4 (zigzag: two pieces of 4)
EP_RATE = 0.1


def _expert_axis(cp: int, split: int):
    """The mesh axes that split the fixture's 8 experts `split` ways on a (dp=2, cp) mesh:
    the context axis itself where it has `split` ranks, else the data axis or both."""
    if split == 1:
        return None
    if split == cp:
        return "cp"
    return "dp" if split == DP else ("dp", "cp")


@ft.cache
def _ep_batch():
    tokens = np.random.default_rng(0).integers(0, 64, (DP, EP_TOKENS + 1))
    return jnp.asarray(tokens[:, :-1], jnp.int32), jnp.asarray(tokens[:, 1:], jnp.int32)


def _ep_loss(model, inputs, targets, cp=None, expert_axis=None, axes=()):
    """The mean next-token loss plus the load-balancing loss (the routing summed over the
    batch and every rank, as transformers sums it over the batch), and the logits."""
    logits, stats = jax.vmap(
        lambda t: model.logits_and_router_stats(t, cp=cp, expert_axis=expert_axis)
    )(inputs)
    nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
    count = jnp.asarray(targets.size, jnp.float32)
    stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
    if axes:
        nll, count, stats = jax.lax.psum((nll, count, stats), axes)
    aux = model.config.router_aux_loss_coef * load_balancing_loss(stats)
    return nll / count + aux, logits


@ft.cache
def _ep_reference():
    """One device: the loss, its gradients and the logits."""
    model = _model("next")
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, inputs, targets):
        return _ep_loss(eqx.combine(params, static), inputs, targets)

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params, *_ep_batch())


def _ep_cases():
    """cp x the expert split x the layout: cp-as-ep (cp = 4, four ways, zigzag) in the
    default run; in the slow run a cover in which every pair of values of any two axes
    meets (5 more cases; the full grid is 12)."""
    return pairwise(
        [(2, 4), (1, 2, 4), (Contiguous(), Zigzag())],
        ids=[lambda cp: f"cp{cp}", lambda n: f"experts{n}", lambda lay: type(lay).__name__],
        # The default run trains the MoE model with its experts split in test_fsdp.py and
        # test_scanned_training_step_with_experts_split; this grid runs in the slow suite.
        fast=lambda cp, split, layout: False,
        slow_cover=[(0, 1), (0, 2), (1, 2)],
    )


# 25 to 50 s per case (one training step of the 4-layer model compiled under shard_map).
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("cp, split, layout", _ep_cases())
def test_training_step_with_experts_split(cp, split, layout):
    # The batch over "dp", time over "cp", the routed experts split `split` ways: the
    # loss, the logits, every gradient and the new parameters of an optax step equal one
    # device's, and no device holds every expert.
    import optax

    model = _model("next")
    params, static = eqx.partition(model, eqx.is_array)
    axis = _expert_axis(cp, split)
    mesh = jax.make_mesh(
        (DP, cp), ("dp", "cp"), devices=jax.devices()[: DP * cp], axis_types=(AxisType.Auto,) * 2
    )
    specs = expert_partition_specs(params, axis) if axis else jax.tree.map(lambda _: P(), params)
    seq = P("dp", "cp")
    context = ContextParallel("cp", layout=layout)

    def local(params, inputs, targets):
        m = eqx.combine(params, static)
        return _ep_loss(m, inputs, targets, context, axis, ("dp", "cp"))

    def loss(params, inputs, targets):
        inputs, targets = layout.to_layout(inputs, cp), layout.to_layout(targets, cp)
        value, logits = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=(P(), seq)
        )(params, inputs, targets)
        return value, layout.from_layout(logits, cp)

    optimizer = optax.sgd(EP_RATE, momentum=0.9)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, logits, grads, optax.apply_updates(params, updates)

    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    experts = params.layers[0].mlp.experts.gate_proj
    assert experts.sharding.shard_shape(experts.shape)[0] == 8 // split
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        value, logits, grads, new = step(params, optimizer.init(params), *_ep_batch())
    (value1, logits1), grads1 = _ep_reference()
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    assert rel_err(logits, logits1) <= 1e-5
    # The gradients to 1e-4: one device's float32 gradients of this model are 1.1e-5 from
    # float64 (measured), so two float32 runs summing in different orders differ by up to
    # a few times that (2.5e-5 measured at cp = 4, every split).
    errors = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    expected = jax.tree.map(lambda p, g: p - EP_RATE * g, params, grads1)
    assert max(jax.tree.leaves(jax.tree.map(rel_err, new, expected))) <= 1e-5


# About 20 s (a training step of the scanned model compiled under shard_map): slow; the
# default run's check of the scanned layers under shard_map is test_fsdp.py's scanned MoE
# step (experts split, FSDP); the dense model's, with two groups, is tests/test_layer_stack.py's.
@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_scanned_training_step_with_experts_split():
    # The layers stacked and scanned (`scan_layers=True`), recomputed in the backward
    # (`remat="layer"`), the batch over "dp", time over cp = 2 (zigzag), the experts split
    # over both axes (their specs on the stack's second axis): the loss, the logits and
    # every gradient equal one device's loop.
    model = Qwen3NextForCausalLM.from_pretrained(
        DATA / "qwen3_next_moe", chunk_size=CHUNK, scan_layers=True
    )
    params, static = eqx.partition(model, eqx.is_array)
    cp, layout, axis = 2, Zigzag(), ("dp", "cp")
    mesh = jax.make_mesh(
        (DP, cp), axis, devices=jax.devices()[: DP * cp], axis_types=(AxisType.Auto,) * 2
    )
    specs = expert_partition_specs(params, axis)
    seq = P("dp", "cp")
    context = ContextParallel("cp", layout=layout)

    def local(params, inputs, targets):
        m = eqx.combine(params, static)
        logits, stats = jax.vmap(
            lambda t: m.logits_and_router_stats(t, cp=context, expert_axis=axis, remat="layer")
        )(inputs)
        nll = -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1))
        stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
        nll, count, stats = jax.lax.psum((nll, jnp.float32(targets.size), stats), axis)
        aux = m.config.router_aux_loss_coef * load_balancing_loss(stats)
        return nll / count + aux, logits

    def loss(params, inputs, targets):
        inputs, targets = layout.to_layout(inputs, cp), layout.to_layout(targets, cp)
        value, logits = jax.shard_map(
            local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=(P(), seq)
        )(params, inputs, targets)
        return value, layout.from_layout(logits, cp)

    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, *_ep_batch())
    (value1, logits1), grads1 = _ep_reference()
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    assert rel_err(logits, logits1) <= 1e-5
    grads = eqx.tree_at(lambda g: g.layers, grads, tuple(grads.layers))
    errors = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors


# About 12 s (a context-parallel prefill of the 4-layer model, one device's prefill and two
# decode steps).
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.slow
def test_prefill_with_experts_split_then_decode():
    # A prompt prefilled on 2 ranks (contiguous shards), the experts split over the same
    # axis: the logits, and the next token decoded from its cache, equal one device's.
    model = _model("next")
    tokens = _ep_batch()[0][0]
    params, static = eqx.partition(model, eqx.is_array)
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    context = ContextParallel("cp")

    def local(params, tokens):
        m = eqx.combine(params, static)
        return m.prefill(tokens, capacity=EP_TOKENS + 1, cp=context, expert_axis="cp")

    sharded = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(expert_partition_specs(params, "cp"), P("cp")),
        out_specs=(P("cp"), P()),
    )
    logits, cache = jax.jit(sharded)(params, tokens)
    want, want_cache = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=EP_TOKENS + 1))(
        model, tokens
    )
    assert rel_err(logits, want) <= 1e-5
    step = eqx.filter_jit(lambda m, t, c: m.decode_step(t, c)[0])
    assert rel_err(step(model, tokens[-1], cache), step(model, tokens[-1], want_cache)) <= 1e-5


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


def test_top_k_more_than_experts_is_refused(getkey):
    with pytest.raises(ValueError, match=r"`top_k` \(5\) is more than the 4 experts"):
        SparseMoE(8, 4, 5, 6, 4, key=getkey())
    fields = json.loads((DATA / "qwen3_5_moe" / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"`num_experts_per_tok` \(9\) is more than its `num_experts` \(8\)"
    ):
        Qwen3_5MoeConfig.from_hf({**fields, "num_experts_per_tok": 9})


def test_missing_expert_is_named(tmp_path):
    def change(tensors, config):
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
        tensors["model.layers.0.mlp.experts.8.up_proj.weight"] = np.ones((8, 24), np.float32)
        tensors["model.layers.3.mlp.gate.weight"] = tensors["model.layers.3.mlp.gate.weight"][:7]
        return tensors, config

    path = _rewrite(tmp_path, "next", change)
    with pytest.raises(ValueError) as info:
        Qwen3NextForCausalLM.from_pretrained(path)
    message = str(info.value)
    for part in (
        "1 missing: model.layers.2.mlp.experts.5.up_proj.weight",
        "1 unexpected: model.layers.0.mlp.experts.8.up_proj.weight",
        "1 misshapen: model.layers.3.mlp.gate.weight: (7, 24), expected (8, 24)",
    ):
        assert part in message, message


def test_configs_of_other_models_are_refused(tmp_path):
    shutil.copytree(DATA / "qwen3_5_moe", tmp_path / "moe")
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_moe_text'.*Qwen3_5MoeConfig"):
        Qwen3NextForCausalLM.from_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_moe_text'.*Qwen3_5MoeConfig"):
        Qwen3_5ForCausalLM.from_pretrained(tmp_path / "moe")
    with pytest.raises(ValueError, match=r"model_type 'qwen3_next'.*Qwen3NextConfig"):
        Qwen3_5MoeForCausalLM.from_pretrained(DATA / "qwen3_next_moe")
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5_text'.*Qwen3_5Config"):
        Qwen3NextConfig.from_json(DATA / "qwen3_5_lm")
    with pytest.raises(ValueError, match="missing `num_experts`"):
        fields = json.loads((DATA / "qwen3_5_lm" / "config.json").read_text())
        del fields["model_type"]
        Qwen3_5MoeConfig.from_hf(fields)
    assert Qwen3_5Config.from_json(DATA / "qwen3_5_lm").intermediate_size == 32


def test_dense_model_has_no_router_stats():
    fields = json.loads((DATA / "qwen3_5_lm" / "config.json").read_text())
    fields.update(num_hidden_layers=1, layer_types=["full_attention"])
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf(fields), key=jr.key(0))
    with pytest.raises(ValueError, match="has no mixture-of-experts layers"):
        model.logits_and_router_stats(jnp.arange(3))
    with pytest.raises(ValueError, match=r"`expert_axis='cp'` is for a mixture-of-experts"):
        model(jnp.arange(3), expert_axis="cp")


@pytest.mark.usefixtures("fast_compile_one_test")
def test_expert_split_errors_name_what_to_change(getkey):
    # Traced only (the errors come before anything compiles).
    moe = SparseMoE(8, 6, 2, 4, 4, key=getkey())
    x = jnp.ones((4, 8))
    with pytest.raises(ValueError, match=r"`expert_axis='ep'` names a mesh axis.*no axis|none of"):
        moe(x, expert_axis="ep")
    params, static = eqx.partition(moe, eqx.is_array)

    def call(axis, size, specs):
        mesh = jax.make_mesh(
            (size,), (axis,), devices=jax.devices()[:size], axis_types=(AxisType.Auto,)
        )
        f = jax.shard_map(
            lambda p, x: eqx.combine(p, static)(x, expert_axis=axis)[0],
            mesh=mesh,
            in_specs=(specs, P(axis)),
            out_specs=P(axis),
        )
        jax.eval_shape(f, params, jnp.ones((4 * size, 8)))

    replicated = jax.tree.map(lambda _: P(), params)
    with pytest.raises(ValueError, match=r"router has 6 experts and this rank holds 6.*3 per rank"):
        call("ep", 2, replicated)
    with pytest.raises(ValueError, match=r"6 experts cannot be split evenly over 4 ranks"):
        call("ep", 4, replicated)


@pytest.mark.usefixtures("fast_compile_one_test")
def test_experts_on_the_wrong_mesh_axis_are_refused(getkey):
    # Traced only. Four devices as (a=2, b=2); 4 experts sharded over "a" (2 a rank). With
    # `expert_axis="b"` (as large) each rank ran another rank's experts; with `None` the
    # ranks ran 2 of the 4 experts each: both silently wrong, now refused by the axes the
    # weights vary over and the count of experts held.
    moe = SparseMoE(8, 4, 2, 4, 4, key=getkey())
    params, static = eqx.partition(moe, eqx.is_array)
    mesh = jax.make_mesh(
        (2, 2), ("a", "b"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )

    def trace(split, axis, call=lambda m, x, axis: m(x, expert_axis=axis)[0]):
        f = jax.shard_map(
            lambda p, x: call(eqx.combine(p, static), x, axis),
            mesh=mesh,
            in_specs=(expert_partition_specs(params, split), P(("a", "b"))),
            out_specs=P(("a", "b")),
        )
        return jax.eval_shape(f, params, jnp.ones((16, 8)))

    assert trace("a", "a").shape == (16, 8)  # the right axis
    with pytest.raises(ValueError, match=r"`expert_axis='b'`, but the experts' weights are split"):
        trace("a", "b")
    with pytest.raises(ValueError, match=r"holds 2 of them with `expert_axis=None`.*\['a'\]"):
        trace("a", None)

    def experts_alone(m, x, axis):
        ids = jnp.zeros((x.shape[0], 2), jnp.int32).at[:, 1].set(1)
        return m.experts(x, ids, jnp.ones((x.shape[0], 2)), expert_axis=axis)

    with pytest.raises(ValueError, match=r"`expert_axis='b'`, but the experts' weights are split"):
        trace("a", "b", experts_alone)


def test_bad_expert_arguments_name_what_to_change(getkey, without_runtime_typecheck):
    moe = SparseMoE(8, 4, 2, 6, 4, key=getkey())
    experts, x = moe.experts, jnp.ones((5, 8))
    ids, weights = jnp.zeros((5, 2), jnp.int32).at[:, 1].set(1), jnp.ones((5, 2))
    with pytest.raises(ValueError, match=r"`norm_topk_prob` must be True or False; got 'no'"):
        SparseMoE(8, 4, 2, 6, 4, norm_topk_prob="no", key=getkey())  # pyright: ignore
    with pytest.raises(TypeError, match=r"`expert_axis` must be None, the name of a mesh axis"):
        moe(x, expert_axis=123)  # pyright: ignore[reportArgumentType]
    with pytest.raises(TypeError, match=r"`experts` must be an integer array.*float32"):
        experts(x, ids.astype(jnp.float32), weights)
    with pytest.raises(ValueError, match=r"`weights` must have the shape of `experts`, \(5, 2\)"):
        experts(x, ids, weights[:, :1])
    with pytest.raises(ValueError, match=r"`experts` must have shape \(seq, k\) with seq = 3"):
        experts(x[:3], ids, weights)  # fewer tokens than rows of ids (a clamped gather)
    with pytest.raises(ValueError, match=r"`x` must have shape \(seq, hidden\) with hidden = 8"):
        moe(jnp.ones((5, 7)))
    # Ids outside [0, E) were dropped silently: concrete ones at the call, traced ones when
    # the computation runs.
    with pytest.raises(ValueError, match=r"ids in \[0, 4\); got 4 at \(2, 1\)"):
        experts(x, ids.at[2, 1].set(4), weights)
    with pytest.raises(RuntimeError, match=r"ids in \[0, 4\)"):
        eqx.filter_jit(lambda i: experts(x, i, weights))(ids.at[0, 0].set(-1)).block_until_ready()

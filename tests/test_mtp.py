"""The multi-token-prediction head (`Qwen3_5MTP`, a model's `logits_and_mtp`): its logits
against a float64 NumPy reference written from the architecture, the `mtp.*` checkpoint
tensors through `save_pretrained` and `from_pretrained`, context parallelism (the next-token
shift across ranks, both layouts) and packed documents (no shift across a document's end);
`next_tokens`, `mtp_labels` and `add_mtp_loss`; a dp x cp training step with the MTP loss and every
parameter sharded (FSDP) against one device's.

The models are tiny random ones of the fixtures' sizes (tests/data/qwen3_5_lm and
qwen3_next_moe configs), two layers [linear, full] and one MTP layer.
"""

import functools as ft
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

import deltanet_cp as dcp
from deltanet_cp.data import add_mtp_loss, causal_lm_loss, IGNORE_INDEX, mtp_labels
from deltanet_cp.models import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MTP,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from deltanet_cp.nn import FSDP, partition_specs, SparseMoE

from .helpers import rel_err


DATA = pathlib.Path(__file__).parent / "data"
T = 24
CU = [0, 8, 8, 16, 24]  # three documents (and an empty one) in the 24 tokens


def _fields(name: str, depth: int, hybrid: bool) -> dict:
    fields = json.loads((DATA / name / "config.json").read_text())
    fields = fields.get("text_config", fields)
    types = ["linear_attention", "full_attention"] if hybrid else ["full_attention"]
    fields.update(num_hidden_layers=len(types), layer_types=types, mtp_num_hidden_layers=depth)
    fields.pop("mlp_only_layers", None)
    return fields


@ft.cache
def _model(kind: str = "dense", depth: int = 1, hybrid: bool = False):
    """A random model with an MTP head: one attention layer (quick to compile: the head does
    not depend on the layers below it), or with `hybrid` a Gated DeltaNet layer and an
    attention layer."""
    if kind == "dense":
        config = Qwen3_5Config.from_hf(_fields("qwen3_5_lm", depth, hybrid))
        return Qwen3_5ForCausalLM(config, chunk_size=4, key=jr.key(0))
    if kind == "next":
        config = Qwen3NextConfig.from_hf(_fields("qwen3_next_moe", depth, hybrid))
        return Qwen3NextForCausalLM(config, chunk_size=4, key=jr.key(1))
    config = Qwen3_5MoeConfig.from_hf(_fields("qwen3_5_moe", depth, hybrid))
    return Qwen3_5MoeForCausalLM(config, chunk_size=4, key=jr.key(2))


def _tokens(vocab: int) -> jax.Array:
    return jr.randint(jr.key(7), (T,), 0, vocab, dtype=jnp.int32)


@eqx.filter_jit
def _heads(model, tokens, cu_seqlens=None):
    logits, mtp_logits, _ = model.logits_and_mtp(tokens, cu_seqlens=cu_seqlens)
    return logits, mtp_logits


# ---------------------------------------------------------------------------------------
# The head against a float64 reference from the architecture
# ---------------------------------------------------------------------------------------


def _np(x) -> np.ndarray:
    return np.asarray(x, np.float64)


def _rms(x, w, eps):
    """The zero-centred RMSNorm, $x / rms(x) (1 + w)$, over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1 + _np(w))


def _rope(x, position, theta, rotary_dim):
    half = rotary_dim // 2
    angles = position * theta ** (-np.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    c, s = np.cos(angles), np.sin(angles)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., rotary_dim:]], axis=-1)


def _layer_reference(layer, x, config, starts):
    """A full-attention decoder layer (gated attention with q/k norms and a partial rotary
    embedding, SwiGLU MLP), a loop over tokens; `starts[t]` is token `t`'s document's first
    position (the rotary positions restart there and attention stays inside)."""
    a, eps = layer.mixer, config.rms_norm_eps
    heads, kv, d = a.num_heads, a.num_kv_heads, a.head_dim
    h = _rms(x, layer.input_layernorm.weight, eps)
    qg = (h @ _np(a.q_proj.weight).T).reshape(len(x), heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(len(x), heads * d)
    k = (h @ _np(a.k_proj.weight).T).reshape(len(x), kv, d)
    v = (h @ _np(a.v_proj.weight).T).reshape(len(x), kv, d)
    q, k = _rms(q, a.q_norm.weight, eps), _rms(k, a.k_norm.weight, eps)
    out = np.zeros((len(x), heads, d))
    for t in range(len(x)):
        pos_t = t - starts[t]
        qt = _rope(q[t], pos_t, config.rope_theta, config.rotary_dim)
        keys = range(starts[t], t + 1)
        ks = np.stack(
            [_rope(k[j], j - starts[t], config.rope_theta, config.rotary_dim) for j in keys]
        )
        vs = v[starts[t] : t + 1]
        for i in range(heads):
            g = i // (heads // kv)
            s = ks[:, g] @ qt[i] / np.sqrt(d)
            p = np.exp(s - s.max())
            out[t, i] = (p / p.sum()) @ vs[:, g]
    o = out.reshape(len(x), heads * d) / (1 + np.exp(-gate))
    x = x + o @ _np(a.o_proj.weight).T
    h = _rms(x, layer.post_attention_layernorm.weight, eps)
    mlp = layer.mlp
    assert not isinstance(mlp, SparseMoE)
    g, u = h @ _np(mlp.gate_proj.weight).T, h @ _np(mlp.up_proj.weight).T
    return x + (g / (1 + np.exp(-g)) * u) @ _np(mlp.down_proj.weight).T


@eqx.filter_jit
def _trunk(model, tokens, cu):
    x = jax.vmap(model.embed)(tokens)
    for layer in model.layers:
        x, _ = layer(x, None, "allgather", cu_seqlens=cu)
    return x


def _mtp_reference(model, tokens, cu):
    """The depth-0 head's logits from the architecture: the main model's last hidden state
    after its final norm (from the model's own layers: the trunk is checked elsewhere), the
    next token's embedding (token 0 past a document's end), `fc`, the layer, `mtp.norm`, the
    LM head."""
    x = _trunk(model, tokens, None if cu is None else jnp.asarray(cu))
    eps, c = model.config.rms_norm_eps, model.config
    hidden = _rms(_np(x), model.norm.weight, eps)
    ends = {T} if cu is None else set(cu[1:])
    nxt = np.array([0 if t + 1 in ends else int(tokens[t + 1]) for t in range(T)])
    starts = (
        np.zeros(T, int)
        if cu is None
        else np.array([max(s for s in cu if s <= t) for t in range(T)])
    )
    emb = _np(model.embed.weight)
    m = model.mtp
    assert m is not None
    u = np.concatenate(
        [
            _rms(emb[nxt], m.pre_fc_norm_embedding.weight, eps),
            _rms(hidden, m.pre_fc_norm_hidden.weight, eps),
        ],
        axis=-1,
    )
    y = _layer_reference(m.layers[0], u @ _np(m.fc.weight).T, c, starts)
    y = _rms(y, m.norm.weight, eps)
    head = emb if model.lm_head is None else _np(model.lm_head.weight)
    return y @ head.T


@pytest.mark.parametrize(
    "packed, hybrid",
    [
        (True, False),
        pytest.param(False, False, marks=pytest.mark.slow),
        pytest.param(True, True, marks=pytest.mark.slow),
    ],
)
def test_mtp_logits_match_float64_reference(packed, hybrid):
    model = _model(hybrid=hybrid)
    tokens = _tokens(model.config.vocab_size)
    cu = CU if packed else None
    logits, mtp_logits = _heads(model, tokens, None if cu is None else jnp.asarray(cu))
    assert mtp_logits.shape == (1, T, model.config.vocab_size)
    want = _mtp_reference(model, tokens, cu)
    assert rel_err(mtp_logits[0], want) <= 1e-5
    if hybrid:  # the main logits are the model's call
        plain = eqx.filter_jit(lambda m, t, c: m(t, cu_seqlens=c))(
            model, tokens, None if cu is None else jnp.asarray(cu)
        )
        np.testing.assert_array_equal(logits, plain)


@pytest.mark.slow
def test_packed_documents_equal_documents_alone():
    # Each document's head logits alone equal its rows in the packed row: the last token
    # of a document reads token 0 (as at the end of a sequence), never the next document.
    model = _model()
    tokens = _tokens(model.config.vocab_size)
    _, packed = _heads(model, tokens, jnp.asarray(CU))
    for a, b in zip(CU, CU[1:]):
        if a == b:
            continue
        _, alone = _heads(model, tokens[a:b])
        assert rel_err(packed[:, a:b], alone) <= 1e-5


# ---------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------


def test_mtp_round_trip(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    mtp = sorted(n for n in names if n.startswith("mtp."))
    assert mtp == sorted(
        ["mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight"]
        + ["mtp.pre_fc_norm_hidden.weight"]
        + [
            f"mtp.layers.0.{n}.weight"
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        ]
    )
    assert json.loads((tmp_path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    back = Qwen3_5ForCausalLM.from_pretrained(tmp_path, chunk_size=4)
    assert isinstance(back.mtp, Qwen3_5MTP)
    assert eqx.tree_equal(back, model)


def test_config_with_a_head_and_no_mtp_tensors(tmp_path):
    # transformers writes `mtp_num_hidden_layers` and no `mtp.*` tensors: no head, as before.
    model = eqx.tree_at(lambda m: m.mtp, _model(), None)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    back = Qwen3_5ForCausalLM.from_pretrained(tmp_path, chunk_size=4)
    assert back.mtp is None
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        back.logits_and_mtp(_tokens(back.config.vocab_size))


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, experts", [("next", "per_expert"), ("moe", "fused"), ("moe", "per_expert")]
)
def test_mtp_round_trip_experts(tmp_path, kind, experts):
    model = _model(kind)
    assert model.mtp is not None and isinstance(model.mtp.layers[0].mlp, SparseMoE)
    model.save_pretrained(tmp_path, experts=experts)
    names = set(load_file(tmp_path / "model.safetensors"))
    fused = "mtp.layers.0.mlp.experts.gate_up_proj" in names
    assert fused == (experts == "fused")
    assert ("mtp.layers.0.mlp.experts.0.gate_proj.weight" in names) == (not fused)
    back = type(model).from_pretrained(tmp_path, chunk_size=4)
    assert eqx.tree_equal(back, model)


# ---------------------------------------------------------------------------------------
# Context parallelism
# ---------------------------------------------------------------------------------------


def _cp_heads(model, tokens, cp, layout, cu=None):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(model, eqx.is_array)
    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, tokens):
        m = eqx.combine(params, static)
        logits, heads, _ = m.logits_and_mtp(tokens, cp=context, cu_seqlens=cu)
        return logits, heads

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp")), out_specs=(P("cp"), P(None, "cp")))
    shard = jax.device_put(layout.to_layout(tokens, cp, axis=0), NamedSharding(mesh, P("cp")))
    logits, heads = jax.jit(f)(params, shard)
    return layout.from_layout(logits, cp, axis=0), layout.from_layout(heads, cp, axis=1)


@pytest.mark.parametrize(
    "cp, layout, packed, hybrid",
    [
        (2, dcp.Zigzag(), True, False),
        pytest.param(2, dcp.Contiguous(), True, False, marks=pytest.mark.slow),
        pytest.param(2, dcp.Zigzag(), True, True, marks=pytest.mark.slow),
        pytest.param(2, dcp.Contiguous(), False, True, marks=pytest.mark.slow),
        pytest.param(4, dcp.Zigzag(), False, True, marks=pytest.mark.slow),
        pytest.param(4, dcp.Contiguous(), True, True, marks=pytest.mark.slow),
    ],
)
def test_context_parallel_equals_one_device(cp, layout, packed, hybrid):
    model = _model(hybrid=hybrid)
    tokens = _tokens(model.config.vocab_size)
    cu = CU if packed else None
    want_logits, want = _heads(model, tokens, None if cu is None else jnp.asarray(cu))
    logits, heads = _cp_heads(model, tokens, cp, layout, cu)
    assert rel_err(logits, want_logits) <= 1e-5
    assert rel_err(heads, want) <= 1e-5


@pytest.mark.slow
def test_two_depths_chain():
    # Depth 1 reads depth 0's output and the tokens shifted twice (token 0 past an end).
    model = _model(depth=2, hybrid=True)
    tokens = _tokens(model.config.vocab_size)
    _, heads = _heads(model, tokens, jnp.asarray(CU))
    assert heads.shape == (2, T, model.config.vocab_size)
    _, alone = _heads(model, tokens[8:16])
    assert rel_err(heads[:, 8:16], alone) <= 1e-5
    _, cp_heads = _cp_heads(model, tokens, 2, dcp.Zigzag(), CU)
    assert rel_err(cp_heads, heads) <= 1e-5


# ---------------------------------------------------------------------------------------
# The shift, the labels and the loss
# ---------------------------------------------------------------------------------------


def _next_reference(x, cu, fill):
    ends = {len(x)} | set(cu[1:] if cu is not None else [])
    return np.array([fill if t + 1 in ends else x[t + 1] for t in range(len(x))])


@pytest.mark.parametrize(
    "cp, layout, packed",
    [
        (4, dcp.Zigzag(), True),
        (2, dcp.Contiguous(), True),
        pytest.param(4, dcp.Contiguous(), False, marks=pytest.mark.slow),
        pytest.param(2, dcp.Zigzag(), False, marks=pytest.mark.slow),
        pytest.param(4, dcp.Contiguous(), True, marks=pytest.mark.slow),
        pytest.param(2, dcp.Zigzag(), True, marks=pytest.mark.slow),
    ],
)
def test_next_tokens_across_ranks(cp, layout, packed):
    x = np.arange(100, 100 + T, dtype=np.int32)
    cu = CU if packed else None
    want = _next_reference(x, cu, -1)
    np.testing.assert_array_equal(
        dcp.next_tokens(jnp.asarray(x)[None], cu_seqlens=cu, fill=-1)[0], want
    )
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    context = dcp.ContextParallel("cp", layout=layout)
    f = jax.shard_map(
        lambda x: dcp.next_tokens(x[None], cp=context, cu_seqlens=cu, fill=-1)[0],
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=P("cp"),
    )
    sharded = jax.device_put(layout.to_layout(x, cp, axis=0), NamedSharding(mesh, P("cp")))
    got = layout.from_layout(jax.jit(f)(sharded), cp, axis=0)
    np.testing.assert_array_equal(got, want)


def test_mtp_labels_and_loss():
    labels = np.arange(1, T + 1, dtype=np.int32)
    labels[[7, 15, 23]] = IGNORE_INDEX  # each document's last token has no target
    got = mtp_labels(jnp.asarray(labels), 2, cu_seqlens=CU)
    one = _next_reference(labels, CU, IGNORE_INDEX)
    np.testing.assert_array_equal(got, np.stack([one, _next_reference(one, CU, IGNORE_INDEX)]))
    logits = jr.normal(jr.key(3), (2, T, 30))
    total = add_mtp_loss(jnp.float32(1.5), logits, got, 0.3)
    parts = [causal_lm_loss(logits[k], got[k])[0] for k in range(2)]
    np.testing.assert_allclose(total, 1.5 + 0.3 * (parts[0] + parts[1]) / 2, rtol=1e-6)
    with pytest.raises(ValueError, match="`weight`"):
        add_mtp_loss(jnp.float32(0), logits, got, -1.0)
    with pytest.raises(ValueError, match="`labels`"):
        add_mtp_loss(jnp.float32(0), logits, got[0], 0.1)


# ---------------------------------------------------------------------------------------
# Self-speculative decoding
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True])
def test_speculative_generate_is_generate(hybrid):
    # A random head guesses wrong nearly always: each step drops its guess and rebuilds the
    # cache; a head whose every guess is right (the LM head zeroed: every argmax is token 0)
    # keeps two tokens a step. Both give `generate`'s tokens.
    model = _model(hybrid=hybrid)
    prompt = _tokens(model.config.vocab_size)[:8]
    for m in (model, eqx.tree_at(lambda m: m.lm_head.weight, model, replace_fn=jnp.zeros_like)):
        want = m.generate(prompt, 9)
        got, accepted, steps = m.speculative_generate(prompt, 9)
        np.testing.assert_array_equal(got, want)
        assert 9 <= int(steps) + int(accepted) <= 10
    assert (int(accepted), int(steps)) == (5, 5)


def test_loader_names_missing_and_unexpected_mtp_tensors(tmp_path):
    # With a head in the config and `mtp.*` in the checkpoint, every head tensor is expected
    # and a stray `mtp.*` one is reported (no longer skipped).
    _model().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["mtp.fc.weight"]
    tensors["mtp.layers.0.bogus.weight"] = np.ones(2, np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError) as info:
        Qwen3_5ForCausalLM.from_pretrained(tmp_path, chunk_size=4)
    message = str(info.value)
    assert "1 missing: mtp.fc.weight" in message
    assert "1 unexpected: mtp.layers.0.bogus.weight" in message


# ---------------------------------------------------------------------------------------
# Training with the MTP loss, every parameter sharded (FSDP)
# ---------------------------------------------------------------------------------------


def _mtp_loss(model, inputs, labels, axes=None, **kw):
    """The next-token loss plus the MTP loss (weight 0.3) of a batch of rows."""
    cp = kw.get("cp")
    logits, heads, _ = jax.vmap(lambda t: model.logits_and_mtp(t, **kw))(inputs)
    depth = model.config.mtp_num_hidden_layers
    targets = jax.vmap(lambda row: mtp_labels(row, depth, cp=cp))(labels)
    loss, _ = causal_lm_loss(logits, labels, axis_name=axes)
    return add_mtp_loss(loss, heads, targets, 0.3, axis_name=axes)


# About 25 s (one training step compiled under shard_map, and one device's).
@pytest.mark.usefixtures("fast_compile_one_test")
def test_training_step_with_mtp_loss_and_fsdp():
    # Two rows over "dp", each over cp = 2 zigzag ranks; every parameter, the head's too,
    # split over "dp" and gathered where it runs (the head with its depth's layer), each
    # layer recomputed in the backward: the loss and every gradient equal one device's.
    model = _model()
    vocab = model.config.vocab_size
    rows = jr.randint(jr.key(11), (2, T + 1), 0, vocab, dtype=jnp.int32)
    inputs, labels = rows[:, :-1], rows[:, 1:]
    params, static = eqx.partition(model, eqx.is_array)

    def one(params):
        return _mtp_loss(eqx.combine(params, static), inputs, labels)

    value1, grads1 = jax.jit(jax.value_and_grad(one))(params)

    mesh = jax.make_mesh(
        (2, 2), ("dp", "cp"), devices=jax.devices()[:4], axis_types=(AxisType.Auto,) * 2
    )
    specs = partition_specs(params, mesh, data_axis="dp")
    layout, seq = dcp.Zigzag(), P("dp", "cp")
    context = dcp.ContextParallel("cp", layout=layout)
    kw = dict(cp=context, fsdp=FSDP("dp", specs), remat="layer")

    def local(params, inputs, labels):
        return _mtp_loss(eqx.combine(params, static), inputs, labels, ("dp", "cp"), **kw)

    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=P())
    optimizer = optax.adamw(1e-2)

    @jax.jit
    def step(params, inputs, labels):
        value, grads = jax.value_and_grad(loss)(params, inputs, labels)
        updates, _ = optimizer.update(grads, optimizer.init(params), params)
        return value, grads, optax.apply_updates(params, updates)

    def put(tree, specs):
        return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    placed = put(params, specs)
    batch = [put(layout.to_layout(a, 2), seq) for a in (inputs, labels)]
    with jax.numpy_dtype_promotion("standard"):
        value, grads, _ = step(placed, *batch)
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    errors = jax.tree.map(rel_err, jax.device_get(grads), grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors
    # The head's parameters are split as any other's, on the devices and in the gradients.
    assert specs.mtp.fc.weight == P(None, "dp")
    fc, grad_fc = placed.mtp.fc.weight, grads.mtp.fc.weight
    h = model.config.hidden_size
    assert {s.data.shape for s in (*fc.addressable_shards, *grad_fc.addressable_shards)} == {(h, h)}

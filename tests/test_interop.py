"""deltanet_cp.interop: Hugging Face weights, and other libraries' call shapes.

Weights: golden outputs of transformers' Qwen3-Next / Qwen3.5 Gated DeltaNet. Call shapes:
the flash-linear-attention and transformers adapters against the deltanet_cp calls they
name, and transformers' torch kernels' golden outputs. The fixtures in tests/data were
written by tests/data/make_hf_fixtures.py (transformers 5.24, torch 2.13, CPU float32);
nothing here imports torch.
"""

import functools as ft
import inspect
import json
import re
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

import deltanet_cp as dcp
from deltanet_cp import interop
from deltanet_cp.interop import (
    fla,
    gated_delta_net_from_hf,
    gated_delta_net_to_hf,
    kimi_delta_attention_from_hf,
    kimi_delta_attention_to_hf,
    transformers as hf,
)
from deltanet_cp.nn import GatedDeltaNet

from .helpers import (
    make_delta_inputs,
    make_delta_product_inputs,
    make_dplr_inputs,
    make_gated_delta_inputs,
    make_gdn2_inputs,
    make_gla_inputs,
    make_kda_inputs,
    make_momentum_inputs,
    rel_err,
    split_momentum_state,
)


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


DATA = Path(__file__).resolve().parent / "data"
NAMES = ["qwen3_next_gdn", "qwen3_5_gdn"]
PREFIX = "model.layers.0.linear_attn."


@ft.cache
def _fixture(name):
    config = json.loads((DATA / f"{name}.json").read_text())
    return (
        config,
        load_file(str(DATA / f"{name}.safetensors")),
        load_file(str(DATA / f"{name}_io.safetensors")),
    )


@ft.cache
def _layer(name) -> GatedDeltaNet:
    return gated_delta_net_from_hf(_fixture(name)[0], DATA / f"{name}.safetensors")


_call = eqx.filter_jit(lambda m, x: m(x))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("t", [37, 130])
def test_matches_transformers(name, t):
    _, _, io = _fixture(name)
    out = _call(_layer(name), jnp.asarray(io[f"x_{t}"][0]))
    assert rel_err(out, io[f"out_{t}"][0]) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_intermediates_match_transformers(name):
    """q, k, v after conv + SiLU, the norm gate z, and the gates g, beta."""
    _, _, io = _fixture(name)
    layer = _layer(name)
    inputs = eqx.filter_jit(lambda m, x: m.recurrence_inputs(x))(layer, jnp.asarray(io["x_37"][0]))
    for key, value in zip(["q", "k", "v", "z", "g", "beta"], inputs):
        assert rel_err(value, io[f"{key}_37"][0]) <= 1e-5, key
    for t in (37, 130):
        g, beta = eqx.filter_jit(lambda m, x: m.recurrence_inputs(x)[4:])(
            layer, jnp.asarray(io[f"x_{t}"][0])
        )
        assert rel_err(g, io[f"g_{t}"][0]) <= 1e-5
        assert rel_err(beta, io[f"beta_{t}"][0]) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers(name):
    """Prefill 20 tokens, then generate the other 17 one `step` at a time."""
    _, _, io = _fixture(name)
    layer = _layer(name)
    x = jnp.asarray(io["x_37"][0])
    y, state = eqx.filter_jit(lambda m, x: m.prefill(x)[:2])(layer, x[:20])
    step = eqx.filter_jit(GatedDeltaNet.step)
    outs = [y]
    for t in range(20, 37):
        y_t, state = step(layer, x[t], state)
        outs.append(y_t[None])
    assert rel_err(jnp.concatenate(outs), io["out_37"][0]) <= 1e-5


def test_context_parallel_matches_transformers():
    """The loaded Qwen3-Next layer, sequence-sharded over 2 ranks, against transformers."""
    name = "qwen3_next_gdn"
    _, _, io = _fixture(name)
    layer = _layer(name)
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    seq = P(None, "cp")
    f = jax.shard_map(
        lambda x: jax.vmap(ft.partial(layer, cp=dcp.ContextParallel("cp")))(x),
        mesh=mesh,
        in_specs=seq,
        out_specs=seq,
    )
    x = jax.device_put(jnp.asarray(io["x_130"]), NamedSharding(mesh, seq))
    assert rel_err(jax.jit(f)(x), io["out_130"]) <= 1e-5


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5"])
def test_export_round_trip(layout):
    """`to_hf` reproduces each fixture's tensors exactly, and `from_hf` inverts it."""
    name = {"qwen3_next": "qwen3_next_gdn", "qwen3_5": "qwen3_5_gdn"}[layout]
    config, weights, _ = _fixture(name)
    layer = _layer(name)
    exported = gated_delta_net_to_hf(layer, layout=layout, prefix=PREFIX)
    assert sorted(exported) == sorted(weights)
    for key, value in weights.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
    # Across layouts: Qwen3-Next weights exported as Qwen3.5 load to the same layer.
    other = "qwen3_5" if layout == "qwen3_next" else "qwen3_next"
    again = gated_delta_net_from_hf(config, gated_delta_net_to_hf(layer, layout=other))
    assert eqx.tree_equal(again, layer)


@pytest.mark.parametrize("layout", ["transformers", "moonshot"])
def test_kimi_delta_attention_export_round_trip(layout, tmp_path, without_runtime_typecheck):
    """`kimi_delta_attention_to_hf` reproduces transformers' tensors of the Kimi fixture
    exactly, and `kimi_delta_attention_from_hf` reads both layouts back bit-identically (from
    a mapping and from a safetensors file)."""
    config = json.loads((DATA / "kimi_kda.json").read_text())
    weights = load_file(str(DATA / "kimi_kda.safetensors"))
    prefix = config["weight_prefix"]
    layer = kimi_delta_attention_from_hf(config, weights)
    exported = kimi_delta_attention_to_hf(layer, layout=layout, prefix=prefix)
    if layout == "transformers":
        assert sorted(exported) == sorted(weights)
        for key, value in weights.items():
            assert exported[key].dtype == value.dtype, key
            np.testing.assert_array_equal(exported[key], value, err_msg=key)
    else:
        assert prefix + "q_conv1d.weight" in exported and prefix + "conv1d.weight" not in exported
    save_file(exported, tmp_path / "kda.safetensors")
    for source in (exported, tmp_path / "kda.safetensors"):
        assert eqx.tree_equal(kimi_delta_attention_from_hf(config, source), layer)
    with pytest.raises(ValueError, match="layout"):
        kimi_delta_attention_to_hf(layer, layout="fla")  # pyright: ignore[reportArgumentType]


def test_weights_sources(tmp_path):
    """Mappings of numpy or JAX arrays, any prefix (or none), files, directories, configs."""
    config, weights, io = _fixture("qwen3_5_gdn")
    expected = _layer("qwen3_5_gdn")
    short = {k[len(PREFIX) :]: v for k, v in weights.items()}
    qwen35 = {f"model.language_model.layers.7.linear_attn.{k}": v for k, v in short.items()}
    as_jax = {k: jnp.asarray(v) for k, v in weights.items()}
    for source in (short, qwen35, as_jax):
        assert eqx.tree_equal(gated_delta_net_from_hf(config, source), expected)
    # Transformers-style config objects, and Qwen3.5's nested text_config.
    obj = types.SimpleNamespace(**config)
    nested = {"model_type": "qwen3_5", "text_config": config}
    for cfg in (obj, nested):
        assert eqx.tree_equal(gated_delta_net_from_hf(cfg, short), expected)
    # A directory of shards holding two layers: pick one with `prefix=`.
    other = {f"model.layers.1.linear_attn.{k}": v for k, v in short.items()}
    save_file(dict(weights), str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(other, str(tmp_path / "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="pass `prefix=`"):
        gated_delta_net_from_hf(config, tmp_path)
    loaded = gated_delta_net_from_hf(config, str(tmp_path), prefix="model.layers.1.linear_attn.")
    assert eqx.tree_equal(loaded, expected)
    # dtype conversion
    half = gated_delta_net_from_hf(config, short, dtype=jnp.bfloat16)
    assert half.in_proj_qkv.weight.dtype == jnp.bfloat16 and half.A_log.dtype == jnp.bfloat16


def test_clear_errors(tmp_path):
    config, weights, _ = _fixture("qwen3_next_gdn")
    short = {k[len(PREFIX) :]: v for k, v in weights.items()}

    missing = dict(short)
    del missing["dt_bias"]
    with pytest.raises(ValueError, match="Missing tensor 'dt_bias'"):
        gated_delta_net_from_hf(config, missing)
    missing = {PREFIX + k: v for k, v in short.items() if k != "in_proj_ba.weight"}
    with pytest.raises(ValueError, match=f"Missing tensor '{PREFIX}in_proj_ba.weight'"):
        gated_delta_net_from_hf(config, missing)

    bad = dict(short, **{"conv1d.weight": short["conv1d.weight"][..., :3]})
    with pytest.raises(
        ValueError, match=r"'conv1d.weight' has shape \(96, 1, 3\); expected \(96, 1, 4\)"
    ):
        gated_delta_net_from_hf(config, bad)
    with pytest.raises(ValueError, match="'out_proj.weight' has shape"):
        gated_delta_net_from_hf(
            config, dict(short, **{"out_proj.weight": short["out_proj.weight"].T})
        )

    with pytest.raises(ValueError, match=r"Unexpected tensor\(s\) \['conv1d.bias'\]"):
        gated_delta_net_from_hf(config, dict(short, **{"conv1d.bias": np.zeros(96, np.float32)}))
    with pytest.raises(ValueError, match="No Gated DeltaNet weights found"):
        gated_delta_net_from_hf(config, {"model.embed_tokens.weight": np.zeros((4, 4))})

    partial = {k: v for k, v in config.items() if k != "linear_key_head_dim"}
    with pytest.raises(ValueError, match="missing `linear_key_head_dim`"):
        gated_delta_net_from_hf(partial, short)
    with pytest.raises(ValueError, match="hidden_act='silu'"):
        gated_delta_net_from_hf(dict(config, hidden_act="gelu"), short)

    pickle_path = tmp_path / "pytorch_model.bin"
    pickle_path.write_bytes(b"not read")
    with pytest.raises(ValueError, match="never pickle"):
        gated_delta_net_from_hf(config, pickle_path)
    with pytest.raises(FileNotFoundError):
        gated_delta_net_from_hf(config, tmp_path / "nope.safetensors")


def _two_layers(weights):
    """The fixture's layer 0 and a copy of it as layer 1: `(layer 0, layer 1)` dicts."""
    short = {k[len(PREFIX) :]: v for k, v in weights.items()}
    return dict(weights), {f"model.layers.1.linear_attn.{k}": v for k, v in short.items()}


def test_sharded_checkpoint_index(tmp_path):
    """A directory with `model.safetensors.index.json` is read through its `weight_map`: a
    stray file holding stale copies of the tensors is ignored (it was read too, and the last
    file in sorted order won, silently)."""
    config, weights, _ = _fixture("qwen3_5_gdn")
    expected = _layer("qwen3_5_gdn")
    layer0, layer1 = _two_layers(weights)
    save_file(layer0, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(layer1, str(tmp_path / "model-00002-of-00002.safetensors"))
    stale = {k: np.zeros_like(v) for k, v in layer0.items()}
    save_file(stale, str(tmp_path / "model-zz-stale.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in layer0}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in layer1}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for source in (tmp_path, index):
        loaded = gated_delta_net_from_hf(config, source, prefix=PREFIX)
        assert eqx.tree_equal(loaded, expected)
    # An index naming a file that is not there, or a tensor not in its file.
    bad = dict(weight_map, **{PREFIX + "A_log": "model-00003-of-00003.safetensors"})
    index.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors"):
        gated_delta_net_from_hf(config, tmp_path, prefix=PREFIX)
    bad = dict(weight_map, **{PREFIX + "A_log": "model-00002-of-00002.safetensors"})
    index.write_text(json.dumps({"weight_map": bad}))
    with pytest.raises(ValueError, match=f"'{PREFIX}A_log' is not in .*model-00002-of-00002"):
        gated_delta_net_from_hf(config, tmp_path, prefix=PREFIX)
    index.write_text("{}")
    with pytest.raises(ValueError, match="weight_map"):
        gated_delta_net_from_hf(config, tmp_path, prefix=PREFIX)


def test_duplicate_tensors_across_files(tmp_path):
    """Without an index, a tensor in two files must be the same in both."""
    config, weights, _ = _fixture("qwen3_5_gdn")
    expected = _layer("qwen3_5_gdn")
    save_file(dict(weights), str(tmp_path / "a.safetensors"))
    save_file(dict(weights), str(tmp_path / "b.safetensors"))  # an identical copy: fine
    assert eqx.tree_equal(gated_delta_net_from_hf(config, tmp_path), expected)
    changed = dict(weights, **{PREFIX + "dt_bias": weights[PREFIX + "dt_bias"] + 1})
    save_file(changed, str(tmp_path / "b.safetensors"))
    with pytest.raises(
        ValueError,
        match=f"Tensor '{PREFIX}dt_bias' is in both 'a.safetensors' and 'b.safetensors', with "
        "different values: remove the stale file, or add .*model.safetensors.index.json",
    ):
        gated_delta_net_from_hf(config, tmp_path)


def test_refuses_non_floating_weights_and_dtype():
    config, weights, _ = _fixture("qwen3_5_gdn")
    short = {k[len(PREFIX) :]: v for k, v in weights.items()}
    for dtype in [np.int32, np.bool_, np.uint8]:
        bad = dict(short, **{"A_log": short["A_log"].astype(dtype)})
        with pytest.raises(ValueError, match="Tensor 'A_log' has dtype .*floating-point"):
            gated_delta_net_from_hf(config, bad)
    for dtype in [jnp.int8, "int32", bool, "not a dtype"]:
        with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype"):
            gated_delta_net_from_hf(config, short, dtype=dtype)


def test_config_sizes_must_be_integers():
    config, weights, _ = _fixture("qwen3_5_gdn")
    short = {k[len(PREFIX) :]: v for k, v in weights.items()}
    expected = _layer("qwen3_5_gdn")
    # A NumPy integer is the same config.
    hidden = config["hidden_size"]
    layer = gated_delta_net_from_hf(dict(config, hidden_size=np.int64(hidden)), short)
    assert eqx.tree_equal(layer, expected)
    # What is not an int (a float, even an integral one, which int() would truncate
    # otherwise) is refused, naming the field, as in deltanet_cp.models.Qwen3_5Config.
    for value in [hidden + 0.9, float(hidden), "32", True]:
        with pytest.raises(ValueError, match="The config's `hidden_size` must be an int"):
            gated_delta_net_from_hf(dict(config, hidden_size=value), short)
    with pytest.raises(ValueError, match="The config's `hidden_size` must be a positive int"):
        gated_delta_net_from_hf(dict(config, hidden_size=0), short)


# ---------------------------------------------------------------------------------------
# Call shapes: deltanet_cp.interop.fla and deltanet_cp.interop.transformers
# ---------------------------------------------------------------------------------------

SCALE = 0.3  # not the default K ** -0.5, so a dropped or misplaced `scale` shows
CU = [0, 13, 40]  # two packed documents, as a list


def _per_document(h0):
    return jnp.concatenate([h0, 0.5 * h0])


def _same(actual, expected, *, tol=0.0):
    """Both `(o, final_state)`; bitwise (tol=0) or to a relative tolerance."""
    assert len(actual) == len(expected) == 2
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
            continue
        assert a is not None and a.shape == e.shape and a.dtype == e.dtype
        if tol == 0.0:
            np.testing.assert_array_equal(a, e)
        else:
            assert rel_err(a, e) <= tol


def _flat(x):
    """(B, T, n, ...) -> FLA's flat (B, T * n, ...) by explicit interleaving: row t * n + j."""
    b, t, n = x.shape[:3]
    flat = np.zeros((b, t * n, *x.shape[3:]), x.dtype)
    for i in range(t):
        for j in range(n):
            flat[:, i * n + j] = x[:, i, j]
    return jnp.asarray(flat)


def _case_chunk_gated_delta_rule(cu):
    (q, k, v, g, beta), h0 = make_gated_delta_inputs(1)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_gated_delta_rule(
        q, k, v, g, beta, SCALE, h0, True, True, cu_seqlens=CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_gated_delta_rule(cu):
    (q, k, v, g, beta), h0 = make_gated_delta_inputs(2)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_gated_delta_rule(
        q, k, v, g, None, None, beta, SCALE, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_fused_recurrent_gated_delta_rule_gk(cu):
    # `g` and `gk` together: the decays multiply, a KDA step with g + gk per key channel.
    (q, k, v, gk, beta), h0 = make_kda_inputs(3)
    g = make_gated_delta_inputs(3)[0][3]
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_gated_delta_rule(
        q, k, v, g=g, gk=gk, beta=beta, scale=SCALE, initial_state=h0, output_final_state=True
    )
    expected = dcp.recurrent_kda(q, k, v, gk + g[..., None], beta, scale=SCALE, initial_state=h0)
    return actual, expected


def _case_fused_recurrent_gated_delta_rule_ungated(cu):
    # Neither gate, and FLA's default beta of ones: the delta rule with beta = 1. FLA's
    # default output_final_state=False: no final state.
    (q, k, v, beta), h0 = make_delta_inputs(4)
    actual = fla.fused_recurrent_gated_delta_rule(q, k, v, initial_state=h0)
    o, _ = dcp.recurrent_delta_rule(q, k, v, jnp.ones_like(beta), initial_state=h0)
    return actual, (o, None)


def _case_chunk_delta_rule(cu):
    (q, k, v, beta), h0 = make_delta_inputs(5)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_delta_rule(
        q, k, v, beta, SCALE, h0, True, True, CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_delta_rule(
        q,
        k,
        v,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_delta_rule(cu):
    (q, k, v, beta), h0 = make_delta_inputs(6)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_delta_rule(
        q, k, v, beta, SCALE, h0, True, True, CU if cu else None
    )
    expected = dcp.recurrent_delta_rule(
        q,
        k,
        v,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_kda(cu):
    (q, k, v, g, beta), h0 = make_kda_inputs(7)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_kda(
        q, k, v, g, beta, SCALE, h0, True, True, cu_seqlens=CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_kda(cu):
    (q, k, v, g, beta), h0 = make_kda_inputs(8)
    h0 = _per_document(h0) if cu else h0
    # FLA's positional order: A_log and dt_bias come before `scale`.
    actual = fla.fused_recurrent_kda(
        q, k, v, g, beta, None, None, SCALE, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_gla(cu):
    (q, k, v, g), h0 = make_gla_inputs(9)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_gla(q, k, v, g, SCALE, h0, True, False, CU if cu else None, chunk_size=16)
    expected = dcp.chunk_gla(
        q,
        k,
        v,
        g,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_gla(cu):
    (q, k, v, g), h0 = make_gla_inputs(10)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_gla(
        q, k, v, g, None, SCALE, h0, True, False, False, CU if cu else None
    )
    expected = dcp.recurrent_gla(
        q,
        k,
        v,
        g,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_simple_gla(cu):
    (q, k, v, g), h0 = make_gla_inputs(11, per_channel=False)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_simple_gla(
        q, k, v, g, None, SCALE, h0, True, False, CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_gla(
        q,
        k,
        v,
        g,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_simple_gla_gamma(cu):
    # RetNet: a constant decay per head, `g_gamma` of shape (HV,).
    (q, k, v, _), h0 = make_gla_inputs(12, per_channel=False)
    gamma = jnp.array([-0.1, -0.02], jnp.float32)
    actual = fla.fused_recurrent_simple_gla(
        q, k, v, g_gamma=gamma, initial_state=h0, output_final_state=True
    )
    expected = dcp.recurrent_gla(q, k, v, jnp.broadcast_to(gamma, v.shape[:3]), initial_state=h0)
    return actual, expected


def _case_chunk_gated_delta_product(cu):
    (q, k, v, g, beta), h0 = make_delta_product_inputs(13, n=3)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_gated_delta_product(
        q,
        _flat(k),
        _flat(v),
        g,
        _flat(beta),
        3,
        SCALE,
        h0,
        True,
        True,
        CU if cu else None,
        chunk_size=16,
    )
    expected = dcp.chunk_gated_delta_product(
        q,
        k,
        v,
        g,
        beta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_chunk_delta_product_ungated(cu):
    (q, k, v, _, beta), h0 = make_delta_product_inputs(14, n=2, gated=False)
    actual = fla.chunk_gated_delta_product(q, _flat(k), _flat(v), None, _flat(beta), 2)
    o, _ = dcp.chunk_gated_delta_product(q, k, v, None, beta)
    return actual, (o, None)


def _case_kimi_delta_attention(cu):
    (q, k, v, g, beta), h0 = make_kda_inputs(15)
    h0 = _per_document(h0) if cu else h0
    actual = hf.chunk_kimi_delta_attention(
        q, k, v, g, beta, 16, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_recurrent_kimi_delta_attention(cu):
    (q, k, v, g, beta), h0 = make_kda_inputs(16)
    h0 = _per_document(h0) if cu else h0
    actual = hf.recurrent_kimi_delta_attention(
        q, k, v, g, beta, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_torch_chunk_gated_delta_rule(cu):
    (q, k, v, g, beta), h0 = make_gated_delta_inputs(17)
    h0 = _per_document(h0) if cu else h0
    actual = hf.torch_chunk_gated_delta_rule(
        q, k, v, g, beta, 16, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_torch_recurrent_gated_delta_rule(cu):
    (q, k, v, g, beta), h0 = make_gated_delta_inputs(18)
    h0 = _per_document(h0) if cu else h0
    actual = hf.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_dplr_delta_rule(cu):
    (q, k, v, a, b, gk), h0 = make_dplr_inputs(31)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_dplr_delta_rule(
        q, k, v, a, b, gk, SCALE, h0, True, CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_dplr_delta_rule(
        q,
        k,
        v,
        a,
        b,
        gk,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_dplr_delta_rule(cu):
    (q, k, v, a, b, gk), h0 = make_dplr_inputs(32)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_dplr_delta_rule(
        q, k, v, a, b, gk, SCALE, h0, True, False, CU if cu else None
    )
    expected = dcp.recurrent_dplr_delta_rule(
        q,
        k,
        v,
        a,
        b,
        gk,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_rwkv7(cu):
    # RWKV-7's order (r, w, k, v, a, b): the queries first, the log decays second.
    (r, k, v, a, b, w), h0 = make_dplr_inputs(33)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_rwkv7(r, w, k, v, a, b, SCALE, h0, True, CU if cu else None, chunk_size=16)
    expected = dcp.chunk_dplr_delta_rule(
        r,
        k,
        v,
        a,
        b,
        w,
        scale=SCALE,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_rwkv7(cu):
    (r, k, v, a, b, w), h0 = make_dplr_inputs(34)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_rwkv7(r, w, k, v, a, b, None, h0, True, CU if cu else None)
    expected = dcp.recurrent_dplr_delta_rule(
        r,
        k,
        v,
        a,
        b,
        w,
        initial_state=h0,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_gdn2(cu):
    (q, k, v, g, b, w), h0 = make_gdn2_inputs(35)
    h0 = _per_document(h0) if cu else h0
    actual = fla.chunk_gdn2(
        q, k, v, g, b, w, SCALE, h0, True, True, cu_seqlens=CU if cu else None, chunk_size=16
    )
    expected = dcp.chunk_gdn2(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_gdn2(cu):
    (q, k, v, g, b, w), h0 = make_gdn2_inputs(36)
    h0 = _per_document(h0) if cu else h0
    actual = fla.fused_recurrent_gdn2(
        q, k, v, g, b, w, None, None, SCALE, h0, True, True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_gdn2(
        q,
        k,
        v,
        g,
        b,
        w,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


def _case_chunk_momentum_delta_rule(cu):
    # FLA's stacked (2, N, HV, K, V) state; p, beta, eta positional after the two decays.
    (q, k, v, la, lm, p, beta, eta), h0 = make_momentum_inputs(37)
    h0 = jnp.asarray(split_momentum_state(_per_document(h0) if cu else h0))
    actual = fla.chunk_momentum_delta_rule(
        q, k, v, la, lm, p, beta, eta, SCALE, h0, True, CU if cu else None, True, False, 16
    )
    expected = dcp.chunk_momentum_delta_rule(
        q,
        k,
        v,
        la,
        lm,
        p,
        beta,
        eta,
        scale=SCALE,
        initial_state=h0,
        use_qk_l2norm=True,
        use_p_times_alpha=False,
        cu_seqlens=jnp.array(CU) if cu else None,
        chunk_size=16,
    )
    return actual, expected


def _case_fused_recurrent_momentum_delta_rule(cu):
    # FLA's defaults: p = k, beta = eta = 1, q/k/p L2-normalised, the probe times alpha.
    (q, k, v, la, lm, _, _, _), h0 = make_momentum_inputs(38)
    h0 = jnp.asarray(split_momentum_state(_per_document(h0) if cu else h0))
    actual = fla.fused_recurrent_momentum_delta_rule(
        q, k, v, la, lm, initial_state=h0, output_final_state=True, cu_seqlens=CU if cu else None
    )
    expected = dcp.recurrent_momentum_delta_rule(
        q,
        k,
        v,
        la,
        lm,
        initial_state=h0,
        use_qk_l2norm=True,
        cu_seqlens=jnp.array(CU) if cu else None,
    )
    return actual, expected


CASES = [
    _case_chunk_gated_delta_rule,
    _case_fused_recurrent_gated_delta_rule,
    _case_fused_recurrent_gated_delta_rule_gk,
    _case_fused_recurrent_gated_delta_rule_ungated,
    _case_chunk_delta_rule,
    _case_fused_recurrent_delta_rule,
    _case_chunk_kda,
    _case_fused_recurrent_kda,
    _case_chunk_gla,
    _case_fused_recurrent_gla,
    _case_chunk_simple_gla,
    _case_simple_gla_gamma,
    _case_chunk_gated_delta_product,
    _case_chunk_delta_product_ungated,
    _case_kimi_delta_attention,
    _case_recurrent_kimi_delta_attention,
    _case_torch_chunk_gated_delta_rule,
    _case_torch_recurrent_gated_delta_rule,
    _case_chunk_dplr_delta_rule,
    _case_fused_recurrent_dplr_delta_rule,
    _case_chunk_rwkv7,
    _case_fused_recurrent_rwkv7,
    _case_chunk_gdn2,
    _case_fused_recurrent_gdn2,
    _case_chunk_momentum_delta_rule,
    _case_fused_recurrent_momentum_delta_rule,
]
PACKED = [
    case
    for case in CASES
    if case
    not in (
        _case_fused_recurrent_gated_delta_rule_gk,
        _case_fused_recurrent_gated_delta_rule_ungated,
        _case_simple_gla_gamma,
        _case_chunk_delta_product_ungated,
    )
]


def _case_id(case) -> str:
    return case.__name__.removeprefix("_case_")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_adapter_equals_deltanet_cp(case):
    """Each adapter is the deltanet_cp call it names, bit for bit."""
    _same(*case(False))


# An FLA chunked adapter (delta rule), transformers' KDA and FLA's RWKV-7 (diagonal plus
# low rank) in the default run; every other packed adapter in the slow run.
PACKED_FAST = (
    _case_chunk_gated_delta_rule,
    _case_kimi_delta_attention,
    _case_chunk_rwkv7,
)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=_case_id(c), marks=() if c in PACKED_FAST else (pytest.mark.slow,))
        for c in PACKED
    ],
)
def test_adapter_cu_seqlens_list(case):
    """`cu_seqlens` as a Python list, against deltanet_cp with an int array."""
    _same(*case(True), tol=1e-6)


# FLA's and transformers' leading positional parameters (flash-linear-attention at
# bc3b101d, Aug 2026; transformers 5.24): the adapters take them in the same order.
FLA_POSITIONAL = {
    "chunk_gated_delta_rule": "q k v g beta scale initial_state output_final_state "
    "use_qk_l2norm_in_kernel",
    "fused_recurrent_gated_delta_rule": "q k v g gk gv beta scale initial_state "
    "output_final_state use_qk_l2norm_in_kernel",
    "chunk_delta_rule": "q k v beta scale initial_state output_final_state "
    "use_qk_l2norm_in_kernel cu_seqlens",
    "fused_recurrent_delta_rule": "q k v beta scale initial_state output_final_state "
    "use_qk_l2norm_in_kernel cu_seqlens",
    "chunk_kda": "q k v g beta scale initial_state output_final_state use_qk_l2norm_in_kernel",
    "fused_recurrent_kda": "q k v g beta A_log dt_bias scale initial_state output_final_state "
    "use_qk_l2norm_in_kernel",
    "chunk_gla": "q k v g scale initial_state output_final_state state_v_first cu_seqlens",
    "fused_recurrent_gla": "q k v gk gv scale initial_state output_final_state reverse "
    "state_v_first cu_seqlens",
    "chunk_simple_gla": "q k v g g_gamma scale initial_state output_final_state state_v_first "
    "cu_seqlens",
    "fused_recurrent_simple_gla": "q k v g g_gamma scale initial_state output_final_state "
    "reverse state_v_first cu_seqlens",
    "chunk_gated_delta_product": "q k v g beta num_householder scale initial_state "
    "output_final_state use_qk_l2norm_in_kernel cu_seqlens",
    "chunk_dplr_delta_rule": "q k v a b gk scale initial_state output_final_state cu_seqlens",
    "fused_recurrent_dplr_delta_rule": "q k v a b gk scale initial_state output_final_state "
    "reverse cu_seqlens",
    "chunk_rwkv7": "r w k v a b scale initial_state output_final_state cu_seqlens",
    "fused_recurrent_rwkv7": "r w k v a b scale initial_state output_final_state cu_seqlens",
    "chunk_gdn2": "q k v g b w scale initial_state output_final_state use_qk_l2norm_in_kernel",
    "fused_recurrent_gdn2": "q k v g b w A_log dt_bias scale initial_state output_final_state "
    "use_qk_l2norm_in_kernel",
    # flash-linear-attention 0.6.0 (fla-core wheel).
    "chunk_momentum_delta_rule": "q k v log_alpha log_mu p beta eta scale initial_state "
    "output_final_state cu_seqlens use_qk_l2norm_in_kernel use_p_times_alpha chunk_size",
    "fused_recurrent_momentum_delta_rule": "q k v log_alpha log_mu p beta eta scale "
    "initial_state output_final_state cu_seqlens use_qk_l2norm_in_kernel use_p_times_alpha",
}
HF_POSITIONAL = {
    "chunk_kimi_delta_attention": "query key value g beta chunk_size initial_state "
    "output_final_state use_qk_l2norm_in_kernel",
    "recurrent_kimi_delta_attention": "query key value g beta initial_state output_final_state "
    "use_qk_l2norm_in_kernel",
    "torch_chunk_gated_delta_rule": "query key value g beta chunk_size initial_state "
    "output_final_state use_qk_l2norm_in_kernel",
    "torch_recurrent_gated_delta_rule": "query key value g beta initial_state "
    "output_final_state use_qk_l2norm_in_kernel",
}


@pytest.mark.parametrize(
    "module, name, expected",
    [(fla, n, e) for n, e in FLA_POSITIONAL.items()]
    + [(hf, n, e) for n, e in HF_POSITIONAL.items()],
    ids=[f"fla.{n}" for n in FLA_POSITIONAL] + [f"transformers.{n}" for n in HF_POSITIONAL],
)
def test_argument_order(module, name, expected):
    parameters = inspect.signature(getattr(module, name)).parameters.values()
    positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == expected.split()
    keywords = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}
    assert "cu_seqlens" in keywords and "cp" in keywords
    if name.startswith("chunk") or name.startswith("torch_chunk"):
        assert "chunk_size" in keywords


def test_scale_is_fla_sixth_positional_argument():
    # (test_adapter_equals_deltanet_cp checks it against deltanet_cp's `scale=` too.)
    (q, k, v, g, beta), _ = make_gated_delta_inputs(19)
    o_scaled, h = fla.chunk_gated_delta_rule(q, k, v, g, beta, SCALE)
    o_keyword, _ = fla.chunk_gated_delta_rule(q, k, v, g, beta, scale=SCALE)
    o_default, _ = fla.chunk_gated_delta_rule(q, k, v, g, beta)
    np.testing.assert_array_equal(o_scaled, o_keyword)
    assert rel_err(o_scaled, o_default) > 1e-2
    assert h is None  # the final state only when asked for


def test_aliases():
    assert fla.chunk_gdn is fla.chunk_gated_delta_rule
    assert fla.fused_recurrent_gdn is fla.fused_recurrent_gated_delta_rule
    assert hf.torch_chunk_kda is hf.chunk_kimi_delta_attention
    assert hf.torch_recurrent_kda is hf.recurrent_kimi_delta_attention
    assert interop.fla is fla and interop.transformers is hf


def _per_value_channel_loop(q, k, v, g, beta, h0, cu, scale):
    """FLA's fused recurrent kernel with a beta per value channel, in float64, token by
    token: decay, then `u = beta * (v - S^T k)` per value channel, `S += k u^T`, `o = S^T q`
    (`g` per head, per key channel or `None`; one key head per `HV / H` value heads)."""
    q, k, v, beta, h0 = (np.asarray(x, np.float64) for x in (q, k, v, beta, h0))
    g = None if g is None else np.asarray(g, np.float64)
    _, t, hv, dv = v.shape
    group = hv // q.shape[2]
    o, finals = np.zeros(v.shape), []
    for n, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        s = h0[n].copy()  # (HV, K, V)
        for i in range(start, end):
            for h in range(hv):
                kk, qq = k[0, i, h // group], q[0, i, h // group] * scale
                if g is not None:
                    decay = np.exp(g[0, i, h])
                    s[h] *= decay[:, None] if decay.ndim else decay
                u = beta[0, i, h] * (v[0, i, h] - kk @ s[h])
                s[h] += np.outer(kk, u)
                o[0, i, h] = qq @ s[h]
        finals.append(s)
    return o, np.stack(finals)


@pytest.mark.parametrize(
    "gate", ["g", "gk", "delta_rule", pytest.param("none", marks=pytest.mark.slow)]
)
def test_fused_recurrent_beta_per_value_channel(gate):
    # FLA's fused recurrent kernels take beta `(B, T, HV, V)`; the adapters refused it.
    # Packed documents, GVA, an initial state per document, the state as (V, K) for one
    # case; against the float64 loop of FLA's kernel. Cost: a token-loop program per case,
    # about 10 s each cold (the ungated gated-delta call in the slow run).
    (q, k, v, g, _), h0 = make_gated_delta_inputs(31)
    gk = make_kda_inputs(31)[0][3]
    beta = jnp.asarray(np.random.default_rng(31).uniform(size=v.shape), jnp.float32)
    h0 = _per_document(h0)
    gates = {"g": dict(g=g), "gk": dict(gk=gk), "none": {}, "delta_rule": {}}[gate]
    v_first = gate == "gk"
    state = jnp.swapaxes(h0, -1, -2) if v_first else h0
    if gate == "delta_rule":
        o, h = fla.fused_recurrent_delta_rule(
            q, k, v, beta, SCALE, state, True, cu_seqlens=jnp.array(CU)
        )
    else:
        o, h = fla.fused_recurrent_gated_delta_rule(
            q,
            k,
            v,
            beta=beta,
            scale=SCALE,
            initial_state=state,
            output_final_state=True,
            state_v_first=v_first,
            cu_seqlens=jnp.array(CU),
            **gates,
        )
    assert h is not None
    h = jnp.swapaxes(h, -1, -2) if v_first else h
    gate_values = {"g": g, "gk": gk}.get(gate)
    want_o, want_h = _per_value_channel_loop(q, k, v, gate_values, beta, h0, CU, SCALE)
    assert o.shape == v.shape and h.shape == h0.shape
    assert rel_err(o, want_o) <= 1e-5 and rel_err(h, want_h) <= 1e-5


def test_fused_recurrent_beta_of_neither_shape(without_runtime_typecheck):
    (q, k, v, g, beta), _ = make_gated_delta_inputs(31)
    with pytest.raises(ValueError, match=r"per value channel \(1, 40, 2, 6\).*got \(1, 40, 2, 3\)"):
        fla.fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=v[..., :3])


def test_state_v_first():
    """FLA's `state_v_first`: the initial and final states are (..., V, K)."""
    (q, k, v, g, beta), h0 = make_kda_inputs(21)
    o, h = fla.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert h is not None
    for fn in (fla.chunk_kda, fla.fused_recurrent_kda):
        o_t, h_t = fn(
            q,
            k,
            v,
            g,
            beta,
            initial_state=jnp.swapaxes(h0, -1, -2),
            output_final_state=True,
            state_v_first=True,
        )
        assert h_t is not None
        assert rel_err(o_t, o) <= 1e-5
        assert rel_err(jnp.swapaxes(h_t, -1, -2), h) <= 1e-5


def test_flat_delta_product_layout(without_runtime_typecheck):
    """FLA's flat layout: row t * num_householder + j of k, v, beta is step j of token t.

    (jaxtyping's checks, off here, catch some of the bad layouts first.)
    """
    (q, k, v, g, beta), h0 = make_delta_product_inputs(22, n=2)
    b, t = q.shape[:2]
    kf, vf, bf = _flat(k), _flat(v), _flat(beta)
    np.testing.assert_array_equal(kf, k.reshape(b, 2 * t, *k.shape[3:]))
    # The other reading of the same rows (row j * T + t) is a different recurrence.
    o, _ = fla.chunk_gated_delta_product(q, kf, vf, g, bf, 2, initial_state=h0)

    def step_major(x):
        return jnp.swapaxes(x.reshape(b, 2, t, *x.shape[2:]), 1, 2)

    o_wrong, _ = dcp.chunk_gated_delta_product(
        q, step_major(kf), step_major(vf), g, step_major(bf), initial_state=h0
    )
    assert rel_err(o_wrong, o) > 1e-2
    with pytest.raises(ValueError, match=r"`k` must have FLA's flat layout"):
        fla.chunk_gated_delta_product(q, kf[:, :-1], vf, g, bf, 2)
    with pytest.raises(ValueError, match=r"`beta` must have FLA's flat layout"):
        fla.chunk_gated_delta_product(q, kf, vf, g, bf[:, :-2], 2)
    with pytest.raises(ValueError, match=r"for `q` of shape .* num_householder=3"):
        fla.chunk_gated_delta_product(q, kf, vf, g, bf, 3)
    with pytest.raises(ValueError, match="`num_householder` must be a positive int"):
        fla.chunk_gated_delta_product(q, kf, vf, g, bf, 0)


def _fla_args(name):
    """Valid positional arguments for each FLA adapter (its required ones)."""
    (q, k, v, g, beta), _ = make_gated_delta_inputs(23, t=8)
    gk = make_kda_inputs(23, t=8)[0][3]
    (_, kf, vf, gp, bp), _ = make_delta_product_inputs(23, t=8)
    dplr, _ = make_dplr_inputs(23, t=8)
    gdn2, _ = make_gdn2_inputs(23, t=8)
    r, kr, vr, ar, br, wr = dplr
    return {
        "chunk_dplr_delta_rule": dplr,
        "fused_recurrent_dplr_delta_rule": dplr,
        "chunk_rwkv7": (r, wr, kr, vr, ar, br),
        "fused_recurrent_rwkv7": (r, wr, kr, vr, ar, br),
        "chunk_gdn2": gdn2,
        "fused_recurrent_gdn2": gdn2,
        "chunk_gated_delta_rule": (q, k, v, g, beta),
        "fused_recurrent_gated_delta_rule": (q, k, v, g),
        "chunk_delta_rule": (q, k, v, beta),
        "fused_recurrent_delta_rule": (q, k, v, beta),
        "chunk_kda": (q, k, v, gk, beta),
        "fused_recurrent_kda": (q, k, v, gk, beta),
        "chunk_gla": (q, k, v, gk),
        "fused_recurrent_gla": (q, k, v, gk),
        "chunk_simple_gla": (q, k, v, g),
        "fused_recurrent_simple_gla": (q, k, v, g),
        "chunk_gated_delta_product": (q, _flat(kf), _flat(vf), gp, _flat(bp), 2),
    }[name]


UNSUPPORTED = [
    ("chunk_gated_delta_rule", "use_gate_in_kernel", True, "pass it as `g`"),
    ("chunk_gated_delta_rule", "A_log", jnp.zeros(2), "an array of shape \\(2,\\)"),
    ("chunk_gated_delta_rule", "dt_bias", jnp.zeros(2), "use_gate_in_kernel=True"),
    ("chunk_gated_delta_rule", "use_beta_sigmoid_in_kernel", True, "jax.nn.sigmoid\\(beta\\)"),
    ("chunk_gated_delta_rule", "allow_neg_eigval", True, "2 \\* jax.nn.sigmoid"),
    ("chunk_gated_delta_rule", "cp_context", object(), "cp=deltanet_cp.ContextParallel"),
    ("chunk_gated_delta_rule", "head_first", True, "\\(B, T, H, ...\\)"),
    ("fused_recurrent_gated_delta_rule", "gv", jnp.zeros((1, 8, 2, 6)), "per value channel"),
    ("fused_recurrent_gated_delta_rule", "use_gate_in_kernel", True, "pass it as `g`"),
    ("chunk_delta_rule", "head_first", True, "head_first"),
    ("chunk_kda", "safe_gate", True, "pass it as `g`"),
    ("chunk_kda", "lower_bound", -5.0, "got -5.0"),
    ("chunk_kda", "return_intermediate_states", True, "not returned"),
    ("chunk_kda", "cp_context", object(), "jax.shard_map"),
    ("fused_recurrent_kda", "A_log", jnp.zeros(2), "A_log"),
    ("fused_recurrent_kda", "dt_bias", jnp.zeros((2, 8)), "dt_bias"),
    ("fused_recurrent_kda", "allow_neg_eigval", True, "allow_neg_eigval"),
    ("fused_recurrent_gla", "gv", jnp.zeros((1, 8, 2, 6)), "per value channel"),
    ("fused_recurrent_gla", "reverse", True, "flip the time axis"),
    ("fused_recurrent_simple_gla", "reverse", True, "flip the time axis"),
    ("chunk_simple_gla", "head_first", True, "head_first"),
    ("chunk_dplr_delta_rule", "safe_gate", True, "pass it as `g`"),
    ("chunk_dplr_delta_rule", "cp_context", object(), "jax.shard_map"),
    ("fused_recurrent_dplr_delta_rule", "reverse", True, "flip the time axis"),
    ("chunk_rwkv7", "lower_bound", -5.0, "got -5.0"),
    ("fused_recurrent_rwkv7", "head_first", True, "head_first"),
    ("chunk_gdn2", "use_gate_in_kernel", True, "pass it as `g`"),
    ("chunk_gdn2", "return_intermediate_states", True, "not returned"),
    ("fused_recurrent_gdn2", "A_log", jnp.zeros(2), "A_log"),
]


@pytest.mark.parametrize(
    "name, option, value, hint", UNSUPPORTED, ids=[f"{n}-{o}" for n, o, *_ in UNSUPPORTED]
)
def test_unsupported_fla_option(name, option, value, hint):
    """FLA options with no counterpart raise a ValueError naming them, never pass silently."""
    fn = getattr(fla, name)
    with pytest.raises(ValueError, match=f"`{option}` is not supported") as info:
        fn(*_fla_args(name), **{option: value})
    assert f"deltanet_cp.interop.fla.{name}" in str(info.value)
    assert re.search(hint, str(info.value)), str(info.value)


def test_fla_options_at_their_defaults_and_hints():
    """Options at FLA's defaults, and those that only steer FLA's kernels, change nothing."""
    args = _fla_args("chunk_kda")
    expected = fla.chunk_kda(*args)
    neutral = dict(
        use_gate_in_kernel=False,
        A_log=None,
        dt_bias=None,
        lower_bound=None,
        safe_gate=False,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        return_intermediate_states=False,
        cp_context=None,
        head_first=False,
        cu_seqlens_cpu=np.array([0, 8]),
        chunk_indices=np.zeros((1, 2), np.int32),
        disable_recompute=True,
    )
    _same(fla.chunk_kda(*args, **neutral), expected)
    args = _fla_args("fused_recurrent_gla")
    _same(fla.fused_recurrent_gla(*args, gv=None, reverse=False), fla.fused_recurrent_gla(*args))


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        fla.chunk_gated_delta_rule(*_fla_args("chunk_gated_delta_rule"), foo=1)
    # An option of another FLA function: FLA's chunk_gla has no qk normalisation.
    with pytest.raises(TypeError, match="use_qk_l2norm_in_kernel"):
        fla.chunk_gla(*_fla_args("chunk_gla"), use_qk_l2norm_in_kernel=True)
    with pytest.raises(TypeError, match="use_qk_l2norm"):
        hf.chunk_kimi_delta_attention(*_fla_args("chunk_kda"), use_qk_l2norm=True)  # pyright: ignore[reportCallIssue]


def _cp_call(name):
    """An adapter's call with every option that touches the state: `(fn, args, kwargs)`."""
    (q, k, v, g, beta), h0 = make_gated_delta_inputs(41)
    (_, _, _, gk, _), _ = make_kda_inputs(41)
    (r, kr, vr, a, b, w), _ = make_dplr_inputs(41)
    state = dict(initial_state=h0, output_final_state=True)
    return {
        # FLA's (V, K) state order, converted on the way in and out.
        "chunk_kda": (
            fla.chunk_kda,
            (q, k, v, gk, beta, SCALE),
            dict(initial_state=jnp.swapaxes(h0, -1, -2), output_final_state=True)
            | dict(state_v_first=True, chunk_size=8),
        ),
        "fused_recurrent_gated_delta_rule": (
            fla.fused_recurrent_gated_delta_rule,
            (q, k, v, g, None, None, beta, SCALE),
            state,
        ),
        "chunk_rwkv7": (fla.chunk_rwkv7, (r, w, kr, vr, a, b, SCALE), state | dict(chunk_size=8)),
        "chunk_simple_gla": (fla.chunk_simple_gla, (q, k, v, g, None, SCALE), state),
        # transformers' output dtype, the query's.
        "torch_chunk_gated_delta_rule": (
            hf.torch_chunk_gated_delta_rule,
            (q, k, v, g, beta, 8),
            state | dict(use_qk_l2norm_in_kernel=True),
        ),
    }[name]


CP_CASES = [
    pytest.param("chunk_kda", dcp.Zigzag(), id="chunk_kda-zigzag"),
    pytest.param("torch_chunk_gated_delta_rule", dcp.Contiguous(), id="torch_chunk-contiguous"),
    pytest.param(
        "fused_recurrent_gated_delta_rule",
        dcp.Zigzag(),
        id="fused_gdn-zigzag",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "chunk_rwkv7", dcp.Contiguous(), id="chunk_rwkv7-contiguous", marks=pytest.mark.slow
    ),
    pytest.param(
        "chunk_simple_gla", dcp.Zigzag(), id="chunk_simple_gla-zigzag", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize("name, layout", CP_CASES)
def test_adapter_context_parallel_global_arrays(name, layout):
    """`cp=` with a mesh: global arrays over 2 devices give the one-device result."""
    fn, args, kwargs = _cp_call(name)
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    cp = dcp.ContextParallel("cp", layout=layout, mesh=mesh)
    _same(fn(*args, **kwargs, cp=cp), fn(*args, **kwargs), tol=1e-5)


def test_adapter_context_parallel_in_shard_map():
    """`cp=` inside the user's `jax.shard_map`: each rank's shard, the global final state."""
    fn, args, kwargs = _cp_call("chunk_kda")
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    seq = P(None, "cp")

    def per_rank(q, k, v, g, beta):  # the scale (args[5]) is static
        return fn(q, k, v, g, beta, args[5], **kwargs, cp=dcp.ContextParallel("cp"))

    f = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,) * 5, out_specs=(seq, P()))
    placed = [jax.device_put(x, NamedSharding(mesh, seq)) for x in args[:5]]
    _same(jax.jit(f)(*placed), fn(*args, **kwargs), tol=1e-5)


def test_cp_context_points_to_cp():
    """FLA's `cp_context` is refused; the message names the keyword to use instead."""
    with pytest.raises(ValueError, match=r"pass `cp=deltanet_cp.ContextParallel\(axis_name\)`"):
        fla.chunk_kda(*_fla_args("chunk_kda"), cp_context=object())


def test_simple_gla_one_decay():
    q, k, v, g = _fla_args("chunk_simple_gla")
    with pytest.raises(ValueError, match="one of `g` and `g_gamma`"):
        fla.chunk_simple_gla(q, k, v, g, jnp.zeros(2))
    # Neither: no decay, plain linear attention.
    _same(fla.chunk_simple_gla(q, k, v), (dcp.chunk_gla(q, k, v, jnp.zeros_like(g))[0], None))


# transformers' golden outputs (tests/data/make_hf_fixtures.py; CPU float32).


def _torch_fixture(name):
    return json.loads((DATA / f"{name}.json").read_text()), load_file(
        str(DATA / f"{name}.safetensors")
    )


@pytest.mark.parametrize(
    "fn",
    [hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention],
    ids=lambda f: f.__name__,
)
def test_kimi_delta_attention_matches_transformers(fn):
    meta, data = _torch_fixture("torch_kda")
    assert meta["function"].endswith("modeling_kimi_linear.chunk_kimi_delta_attention")
    q, k, v, g, beta, h0 = (
        jnp.asarray(data[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")
    )
    # The fixture's own call, keyword for keyword.
    o, h = fn(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, data["out"]) <= 1e-5
    assert rel_err(h, data["final_state"]) <= 1e-5


@pytest.mark.parametrize("suffix", ["", "_gva"], ids=["hv=h", "hv=2h"])
@pytest.mark.parametrize(
    "fn",
    [hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule],
    ids=lambda f: f.__name__,
)
def test_gated_delta_rule_matches_transformers(fn, suffix):
    meta, data = _torch_fixture("torch_chunk_gdn")
    assert meta["function"].endswith("modeling_qwen3_next.torch_chunk_gated_delta_rule")
    names = ("q", "k", "v", "g", "beta", "initial_state")
    q, k, v, g, beta, h0 = (jnp.asarray(data[n + suffix]) for n in names)
    o, h = fn(
        q,
        k,
        v,
        g=g,
        beta=beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert rel_err(o, data["out" + suffix]) <= 1e-5
    assert rel_err(h, data["final_state" + suffix]) <= 1e-5


@pytest.mark.parametrize(
    "fn, reference, make",
    [
        pytest.param(
            hf.chunk_kimi_delta_attention,
            dcp.chunk_kda,
            make_kda_inputs,
            id="chunk_kimi_delta_attention",
        ),
        pytest.param(
            hf.recurrent_kimi_delta_attention,
            dcp.recurrent_kda,
            make_kda_inputs,
            id="recurrent_kimi_delta_attention",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            hf.torch_chunk_gated_delta_rule,
            dcp.chunk_gated_delta_rule,
            make_gated_delta_inputs,
            id="torch_chunk_gated_delta_rule",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            hf.torch_recurrent_gated_delta_rule,
            dcp.recurrent_gated_delta_rule,
            make_gated_delta_inputs,
            id="torch_recurrent_gated_delta_rule",
        ),
    ],
)
def test_transformers_output_dtype_is_query_dtype(fn, reference, make):
    """transformers casts the output to `query`'s dtype; deltanet_cp's own use `value`'s.

    Mixed input dtypes need JAX's standard promotion (the suite runs with strict).
    """
    (q, k, v, g, beta), h0 = make(24)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    with jax.numpy_dtype_promotion("standard"):
        o, h = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        o_v, h_v = reference(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == jnp.bfloat16 and o_v.dtype == jnp.float32
    np.testing.assert_array_equal(o, o_v.astype(jnp.bfloat16))
    assert h is not None and h.dtype == jnp.float32
    np.testing.assert_array_equal(h, h_v)

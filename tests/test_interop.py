"""Hugging Face weights: golden outputs of transformers' Qwen3-Next / Qwen3.5 Gated DeltaNet.

The fixtures in tests/data were written by tests/data/make_hf_fixtures.py (transformers
5.24, torch 2.13, CPU float32); nothing here imports torch.
"""

import functools as ft
import json
import types
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from deltanet_cp.interop import gated_delta_net_from_hf, gated_delta_net_to_hf
from deltanet_cp.nn import GatedDeltaNet

from .helpers import rel_err


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
    y, state = eqx.filter_jit(lambda m, x: m(x, return_state=True))(layer, x[:20])
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
        lambda x: jax.vmap(ft.partial(layer, axis_name="cp"))(x),
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

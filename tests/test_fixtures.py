"""Golden fixtures from transformers (tests/data, made by tests/data/make_hf_fixtures.py):
the library and our float64 loops both agree with transformers' own kernels."""

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file

import deltanet_cp as dcp

from .helpers import gated_delta_reference, kda_reference, rel_err


DATA = pathlib.Path(__file__).parent / "data"


def test_kda_matches_transformers():
    # transformers 5.24 Kimi Linear `chunk_kimi_delta_attention`; see tests/data/torch_kda.json.
    meta = json.loads((DATA / "torch_kda.json").read_text())
    data = load_file(DATA / "torch_kda.safetensors")
    assert meta["case"] == {"B": 1, "T": 100, "H": 2, "K": 16, "V": 8}
    assert "use_qk_l2norm_in_kernel=True" in meta["call"] and "chunk_size=64" in meta["call"]
    q, k, v, g, beta, h0 = (
        jnp.asarray(data[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")
    )
    o, h = jax.jit(
        lambda *a: dcp.chunk_kda(*a[:5], initial_state=a[5], use_qk_l2norm=True, chunk_size=64)
    )(q, k, v, g, beta, h0)
    assert rel_err(o, data["out"]) <= 1e-5
    assert rel_err(h, data["final_state"]) <= 1e-5
    expected_o, expected_h = kda_reference(q, k, v, g, beta, initial_state=h0, l2norm=True)
    assert rel_err(data["out"], expected_o) <= 1e-5  # and the fixture agrees with our loop
    assert rel_err(data["final_state"], expected_h) <= 1e-5


@pytest.mark.parametrize(
    "suffix",
    [
        pytest.param("", id="heads", marks=pytest.mark.slow),
        pytest.param("_gva", id="grouped_heads"),
    ],
)
def test_gated_delta_rule_matches_transformers(suffix):
    # transformers 5.24 Qwen3-Next `torch_chunk_gated_delta_rule`; see torch_chunk_gdn.json.
    meta = json.loads((DATA / "torch_chunk_gdn.json").read_text())
    data = load_file(DATA / "torch_chunk_gdn.safetensors")
    assert "use_qk_l2norm_in_kernel=True" in meta["call"] and "chunk_size=64" in meta["call"]
    names = ("q", "k", "v", "g", "beta", "initial_state")
    q, k, v, g, beta, h0 = (jnp.asarray(data[n + suffix]) for n in names)
    o, h = jax.jit(
        lambda *a: dcp.chunk_gated_delta_rule(
            *a[:5], initial_state=a[5], use_qk_l2norm=True, chunk_size=64
        )
    )(q, k, v, g, beta, h0)
    assert rel_err(o, data["out" + suffix]) <= 1e-5
    assert rel_err(h, data["final_state" + suffix]) <= 1e-5
    expected_o, expected_h = gated_delta_reference(q, k, v, g, beta, initial_state=h0, l2norm=True)
    assert rel_err(data["out" + suffix], expected_o) <= 1e-5
    assert rel_err(data["final_state" + suffix], expected_h) <= 1e-5

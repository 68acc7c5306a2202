"""The Kimi Delta Attention layer: against transformers' `KimiLinearDeltaAttention` (output,
gates, prefill + decode through its cache), the loader's layouts and errors, and context
parallelism (outputs, final state and every gradient equal one device's).

The fixture in tests/data was written by tests/data/make_kimi_fixtures.py (transformers 5.25,
torch 2.13, CPU float32); nothing here imports torch.
"""

import functools as ft
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file

import deltanet_cp as dcp
from deltanet_cp.interop import kimi_delta_attention_from_hf
from deltanet_cp.nn import KimiDeltaAttention, RecurrentLayerState

from .helpers import rel_err


# Small programs: compiling dominates, and XLA's optimisations change nothing but rounding.
pytestmark = pytest.mark.usefixtures("fast_compile")

DATA = Path(__file__).resolve().parent / "data"
PREFIX = "model.layers.0.self_attn."


@ft.cache
def _fixture():
    config = json.loads((DATA / "kimi_kda.json").read_text())
    return (
        config,
        load_file(str(DATA / "kimi_kda.safetensors")),
        load_file(str(DATA / "kimi_kda_io.safetensors")),
    )


@ft.cache
def _layer(chunk_size: int = 64) -> KimiDeltaAttention:
    return kimi_delta_attention_from_hf(
        _fixture()[0], DATA / "kimi_kda.safetensors", chunk_size=chunk_size
    )


@ft.cache
def _full_forward():
    """The loaded layer over the fixture's 70 tokens: `(output, q, k, v, gate, g, beta)`."""
    _, _, io = _fixture()
    return eqx.filter_jit(lambda m, x: (m(x), *m.recurrence_inputs(x)))(
        _layer(), jnp.asarray(io["x"][0])
    )


def _moonshot(weights: dict) -> dict:
    """The fixture's weights under the names of Moonshot's checkpoint (which transformers
    converts when it loads one): three convolutions, the forget gate beside the rest."""
    out = {}
    for name, value in weights.items():
        short = name[len(PREFIX) :]
        if short == "conv1d.weight":
            for x, part in zip("qkv", np.split(value, 3)):
                out[f"{PREFIX}{x}_conv1d.weight"] = part
        else:
            out[PREFIX + short.removeprefix("forget_gate.")] = value
    return out


# ------------------------------------------------------------------------------------------------
# against transformers
# ------------------------------------------------------------------------------------------------
def test_matches_transformers():
    """Output and the gates handed to the kernel, two chunks of 64 tokens (the output after
    the first chunk depends on the state carried out of it: the fixture says by how much)."""
    config, _, io = _fixture()
    assert config["checks"]["rel_change_of_out[67:]_when_first_chunk_dropped"] > 0.1
    out, _, _, _, _, g, beta = _full_forward()
    assert out.dtype == jnp.float32
    assert rel_err(out, io["out"][0]) <= 1e-5
    assert rel_err(g, io["g"][0]) <= 1e-5
    assert rel_err(beta, io["beta"][0]) <= 1e-5


def test_decode_matches_transformers():
    """Prefill 25 tokens, then 6 `step`s: transformers' outputs through its cache, its conv and
    recurrent states, and our own full forward."""
    config, _, io = _fixture()
    layer = _layer()
    p, s = config["prefill"], config["steps"]
    x = jnp.asarray(io["x"][0])
    y, state, _ = eqx.filter_jit(lambda m, x: m.prefill(x))(layer, x[:p])
    step = eqx.filter_jit(KimiDeltaAttention.step)
    outs = [y]
    for t in range(p, p + s):
        y_t, state = step(layer, x[t], state)
        outs.append(y_t[None])
    outs = jnp.concatenate(outs)
    assert rel_err(outs, io["decode_out"][0]) <= 1e-5
    assert rel_err(outs, _full_forward()[0][: p + s]) <= 1e-5
    # transformers keeps the last W inputs as (channels, W); the state holds the last W - 1.
    assert rel_err(state.conv, io["decode_conv"][0].T[1:]) <= 1e-6
    assert rel_err(state.recurrent, io["decode_recurrent"][0]) <= 1e-5
    assert isinstance(state, RecurrentLayerState)


def test_loader_layouts_and_config():
    """Moonshot's names, Moonshot's nested config, a mapping and `dtype` load the same layer."""
    config, weights, _ = _fixture()
    layer = _layer()
    assert (layer.num_heads, layer.head_dim, layer.conv_kernel_size) == (2, 16, 4)
    assert layer.conv_dim == 96 and layer.norm.eps == config["rms_norm_eps"]
    nested = {
        "hidden_size": config["hidden_size"],
        "rms_norm_eps": config["rms_norm_eps"],
        "linear_attn_config": {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4},
    }
    for cfg, w in ((config, weights), (nested, _moonshot(weights))):
        assert bool(eqx.tree_equal(kimi_delta_attention_from_hf(cfg, w), layer))
    half = kimi_delta_attention_from_hf(config, weights, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(half, eqx.is_array))} == {
        jnp.dtype(jnp.bfloat16)
    }


def test_loader_errors():
    """A bad config or bad weights: a `ValueError` naming the field or the tensor."""
    config, weights, _ = _fixture()
    bad_configs = [
        ({k: v for k, v in config.items() if k != "linear_head_dim"}, "`linear_head_dim`"),
        ({k: v for k, v in config.items() if k != "hidden_size"}, "`hidden_size`"),
        ({**config, "linear_num_heads": 2.5}, "linear_num_heads"),
        ({**config, "hidden_act": "gelu"}, "hidden_act='silu'"),
    ]
    for cfg, match in bad_configs:
        with pytest.raises(ValueError, match=match):
            kimi_delta_attention_from_hf(cfg, weights)
    name = PREFIX + "forget_gate.dt_bias"
    bad_weights = [
        ({k: v for k, v in weights.items() if k != name}, f"Missing tensor '{name}'"),
        ({**weights, name: weights[name][:-1]}, f"Tensor '{name}' has shape"),
        ({**weights, name: weights[name].astype(np.int32)}, f"Tensor '{name}' has dtype"),
        ({**weights, PREFIX + "extra": weights[name]}, "Unexpected tensor"),
        ({k[len(PREFIX) :]: v for k, v in weights.items() if "A_log" not in k}, "No Kimi"),
        ({**weights, **{"x." + k: v for k, v in weights.items()}}, "pass `prefix=`"),
    ]
    for w, match in bad_weights:
        with pytest.raises(ValueError, match=match):
            kimi_delta_attention_from_hf(config, w)
    with pytest.raises(ValueError, match="`dtype` must be a floating-point dtype"):
        kimi_delta_attention_from_hf(config, weights, dtype=jnp.int32)
    with pytest.raises(ValueError, match="Only safetensors"):
        kimi_delta_attention_from_hf(config, DATA / "kimi_kda.json")


def test_init():
    layer = eqx.filter_jit(lambda k: KimiDeltaAttention(32, 2, 8, key=k))(jr.key(0))
    assert layer.in_proj_qkv.weight.shape == (48, 32) and layer.conv1d.weight.shape == (48, 4)
    assert layer.dt_bias.shape == (2, 8) and layer.A_log.shape == (2,)
    decay = jax.nn.softplus(layer.dt_bias)
    assert bool(jnp.all((decay > 0.9e-3) & (decay < 1.1e-1)))  # FLA's dt in [1e-3, 1e-1]
    s = layer.init_state()
    assert s.conv.shape == (3, 48) and s.recurrent.shape == (2, 8, 8)
    with pytest.raises(ValueError, match="`head_dim` must be a positive int"):
        KimiDeltaAttention(32, 2, 0, key=jr.key(0))


# ------------------------------------------------------------------------------------------------
# context parallelism
# ------------------------------------------------------------------------------------------------
B, T = 2, 64


@ft.cache
def _cp_problem():
    """The fixture's layer (slow decays on some channels) in chunks of 8, a batch of 2 x 64
    tokens, a random initial state, and random weights for the loss."""
    layer = _layer(8)
    s = layer.init_state()

    @jax.jit
    def draw(key):
        keys = jr.split(key, 6)
        x = jr.normal(keys[0], (B, T, layer.hidden_size))
        state = RecurrentLayerState(
            conv=jr.normal(keys[1], (B, *s.conv.shape)),
            recurrent=0.5 * jr.normal(keys[2], (B, *s.recurrent.shape)),
        )
        w_state = RecurrentLayerState(
            conv=jr.normal(keys[3], state.conv.shape),
            recurrent=jr.normal(keys[4], state.recurrent.shape),
        )
        return x, state, jr.normal(keys[5], x.shape), w_state

    return layer, *draw(jr.key(38))


def _cp_loss_and_grads(cp: int, layout: Any = dcp.Contiguous(), exchange: Any = "allgather"):
    """Output, final state, and the gradients of a loss of both w.r.t. the parameters, the
    input and the state (in sequence order), at CP degree `cp` (1: one device); one
    compiled program."""
    layer, x, state, w_out, w_state = _cp_problem()
    params, static = eqx.partition(layer, eqx.is_array)

    def apply(params, x, state, context=None):
        m = eqx.combine(params, static)
        return jax.vmap(lambda x, s: m.prefill(x, s, cp=context)[:2])(x, state)

    if cp > 1:
        x, w_out = layout.to_layout(x, cp), layout.to_layout(w_out, cp)
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        seq = P(None, "cp")
        apply = jax.shard_map(
            ft.partial(apply, context=dcp.ContextParallel("cp", layout=layout, exchange=exchange)),
            mesh=mesh,
            in_specs=(P(), seq, P()),
            out_specs=(seq, P()),
        )
        x, w_out = (jax.device_put(a, NamedSharding(mesh, seq)) for a in (x, w_out))

    def loss(params, x, state):
        y, new = apply(params, x, state)
        total = jnp.sum(y * w_out) + jnp.sum(new.conv * w_state.conv)
        return total + jnp.sum(new.recurrent * w_state.recurrent), (y, new)

    grads, (y, new) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(params, x, state)
    if cp > 1:
        y = layout.from_layout(y, cp)
        grads = (grads[0], layout.from_layout(grads[1], cp), grads[2])
    return y, new, grads


@ft.cache
def _cp1():
    return _cp_loss_and_grads(1)


def _check_cp(cp: int, layout: Any, exchange: Any = "allgather"):
    y1, new1, grads1 = _cp1()
    y, new, grads = _cp_loss_and_grads(cp, layout, exchange)
    errs = {
        "output": rel_err(y, y1),
        "state": max(jax.tree.leaves(jax.tree.map(rel_err, new, new1))),
        "grads": max(jax.tree.leaves(jax.tree.map(rel_err, grads, grads1))),
    }
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.slow
def test_cp_problem_depends_on_the_carried_state():
    """A wrong hand-off would be seen: the second half from zero states is far off."""
    y1, _, _ = _cp1()
    layer, x, *_ = _cp_problem()
    tail = eqx.filter_jit(jax.vmap(lambda m, x: m(x), in_axes=(None, 0)))(layer, x[:, T // 2 :])
    assert rel_err(tail, y1[:, T // 2 :]) > 1e-2


@pytest.mark.parametrize(
    "cp, layout",
    [
        pytest.param(2, dcp.Contiguous(), id="contiguous-2", marks=pytest.mark.slow),
        pytest.param(4, dcp.Zigzag(), id="zigzag-4"),
        pytest.param(4, dcp.Contiguous(), id="contiguous-4", marks=pytest.mark.slow),
        pytest.param(2, dcp.Zigzag(), id="zigzag-2", marks=pytest.mark.slow),
        pytest.param(8, dcp.Zigzag(), id="zigzag-8", marks=pytest.mark.slow),
    ],
)
def test_cp_invariance(cp, layout):
    """Outputs, final state and every gradient under context parallelism equal one
    device's, with the convolution's halo and the state exchange in both layouts."""
    _check_cp(cp, layout)


@pytest.mark.slow
@pytest.mark.parametrize("exchange", ["ppermute", "ring"])
def test_cp_exchanges(exchange):
    _check_cp(4, dcp.Zigzag(), exchange)

"""Multi-head latent attention (Kimi Linear's attention layer): against a float64 token-by-token
reference written here from the architecture, against transformers' `KimiLinearAttention`
(output, and prefill + decode through its cache), context parallel in both layouts and both
key/value schedules (output and every gradient equal one device's; the compiled program
exchanges the latents, not keys and values),
packed documents, prefill + step decoding, the checkpoint round trip and its errors.

The transformers fixture in tests/data was written by tests/data/make_kimi_mla_fixtures.py
(transformers 5.25, torch 2.13, CPU float32); nothing here imports torch.
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
from deltanet_cp.interop import (
    multi_head_latent_attention_from_hf,
    multi_head_latent_attention_to_hf,
)
from deltanet_cp.nn import LatentKVCache, MultiHeadLatentAttention

from .helpers import rel_err


# Small programs: compiling dominates, and XLA's optimisations change nothing but rounding.
pytestmark = pytest.mark.usefixtures("fast_compile")

DATA = Path(__file__).resolve().parent / "data"
HIDDEN, HEADS = 16, 2
SIZES: dict[str, Any] = dict(kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}


@ft.cache
def _layer(q_lora_rank: int | None = None, tile_size: int = 4) -> MultiHeadLatentAttention:
    """A layer with every parameter perturbed (the norms' weights and the biases too)."""
    layer = MultiHeadLatentAttention(
        HIDDEN,
        HEADS,
        **SIZES,
        q_lora_rank=q_lora_rank,
        attention_bias=q_lora_rank is not None,
        tile_size=tile_size,
        key=jr.key(0),
    )
    leaves, tree = jax.tree.flatten(layer)
    keys = jr.split(jr.key(1), len(leaves))
    leaves = [a + 0.3 * jr.normal(k, a.shape) for a, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference_numpy(layer: MultiHeadLatentAttention, x, cu_seqlens=None) -> np.ndarray:
    """The layer's output, token by token in float64 NumPy, from the architecture:
    queries, the normed latent and the shared key part, keys and values expanded per head,
    causal softmax attention (within each document) scaled by (d_n + d_r)^-1/2, no
    position embedding."""

    def lin(m, a):
        out = a @ np.asarray(m.weight, np.float64).T
        return out if m.bias is None else out + np.asarray(m.bias, np.float64)

    x = np.asarray(x, np.float64)
    t, h = x.shape[0], layer.num_heads
    r, dn = layer.kv_lora_rank, layer.qk_nope_head_dim
    dr, dv = layer.qk_rope_head_dim, layer.v_head_dim
    if layer.q_proj is not None:
        q = lin(layer.q_proj, x)
    else:
        assert layer.q_a_proj and layer.q_a_layernorm and layer.q_b_proj
        qa = _rms(lin(layer.q_a_proj, x), np.asarray(layer.q_a_layernorm.weight, np.float64))
        q = lin(layer.q_b_proj, qa)
    q = q.reshape(t, h, dn + dr)
    ckv = lin(layer.kv_a_proj_with_mqa, x)
    latent = _rms(ckv[:, :r], np.asarray(layer.kv_a_layernorm.weight, np.float64))
    k_rot = ckv[:, r:]
    kv = lin(layer.kv_b_proj, latent).reshape(t, h, dn + dv)
    starts = np.zeros(t, int)
    if cu_seqlens is not None:
        for a in cu_seqlens[:-1]:
            starts[a:] = a
    out = np.zeros((t, h, dv))
    for i in range(t):
        for head in range(h):
            keys = [np.concatenate([kv[j, head, :dn], k_rot[j]]) for j in range(starts[i], i + 1)]
            s = np.array([q[i, head] @ k for k in keys]) / np.sqrt(dn + dr)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, head] = p @ kv[starts[i] : i + 1, head, dn:]
    return lin(layer.o_proj, out.reshape(t, h * dv))


def _x(t: int, seed: int = 2):
    return jr.normal(jr.key(seed), (t, HIDDEN))


@eqx.filter_jit
def _forward(layer, x, cu_seqlens=None):
    return layer(x, cu_seqlens=cu_seqlens)


# ---------------------------------------------------------------------------------------
# One device: the float64 reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_matches_reference(q_lora_rank):
    # 20 tokens in tiles of 4: diagonal tiles and skipped future tiles.
    layer = _layer(q_lora_rank)
    x = _x(20)
    assert rel_err(_forward(layer, x), reference_numpy(layer, x)) <= 1e-5


def test_packed_documents_match_reference_and_each_alone():
    layer = _layer()
    x = _x(20)
    cu = [0, 8, 12, 20]
    got = np.asarray(_forward(layer, x, jnp.asarray(cu, jnp.int32)))
    assert rel_err(got, reference_numpy(layer, x, cu)) <= 1e-5
    alone = np.concatenate([np.asarray(_forward(layer, x[a:b])) for a, b in zip(cu[:-1], cu[1:])])
    assert rel_err(got, alone) <= 1e-5


# ---------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------


@ft.cache
def _hf_fixture():
    desc = json.loads((DATA / "kimi_mla.json").read_text())
    weights = load_file(str(DATA / desc["weights_file"]))
    io = load_file(str(DATA / desc["io_file"]))
    return desc, weights, io


@ft.cache
def _hf_layer(case: str) -> MultiHeadLatentAttention:
    desc, weights, _ = _hf_fixture()
    config = desc["cases"][case]
    return multi_head_latent_attention_from_hf(config, weights, prefix=config["weight_prefix"])


@pytest.mark.parametrize("case", ["plain", "lora"])
def test_matches_transformers(case):
    desc, _, io = _hf_fixture()
    layer = _hf_layer(case)
    assert (layer.q_lora_rank is None) == (case == "plain")
    got = _forward(layer, jnp.asarray(io[f"{case}.x"][0]))
    assert rel_err(got, io[f"{case}.out"][0]) <= 1e-5
    assert rel_err(got, reference_numpy(layer, io[f"{case}.x"][0])) <= 1e-5


def test_decode_matches_transformers():
    # Prefill, then one token at a time, as transformers' cache ran them; the cache holds
    # the same latents.
    desc, _, io = _hf_fixture()
    layer = _hf_layer("plain")
    x = jnp.asarray(io["plain.x"][0])
    p, s = desc["prefill"], desc["steps"]
    cache = layer.init_cache(p + s + 3)
    y, cache = eqx.filter_jit(layer.prefill)(x[:p], cache, 0)
    ys = [np.asarray(y)]
    step = eqx.filter_jit(layer.step)
    for t in range(p, p + s):
        y_t, cache = step(x[t], cache, jnp.asarray(t))  # traced: one program
        ys.append(np.asarray(y_t)[None])
    assert rel_err(np.concatenate(ys), io["plain.decode_out"][0]) <= 1e-5
    assert rel_err(cache.latent[: p + s], io["plain.decode_latent"][0, 0]) <= 1e-6
    assert rel_err(cache.k_rot[: p + s], io["plain.decode_k_rot"][0, 0]) <= 1e-6


def test_checkpoint_round_trip():
    desc, weights, _ = _hf_fixture()
    for case in ("plain", "lora"):
        prefix = desc["cases"][case]["weight_prefix"]
        out = multi_head_latent_attention_to_hf(_hf_layer(case), prefix=prefix)
        mine = {n: a for n, a in weights.items() if n.startswith(prefix)}
        assert sorted(out) == sorted(mine)
        assert all(np.array_equal(out[n], mine[n]) and out[n].dtype == mine[n].dtype for n in out)
    # And a layer of ours through the format and back, bit for bit.
    layer = _layer(12)
    config = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=12, **SIZES)
    back = multi_head_latent_attention_from_hf(
        config | dict(attention_bias=True),
        multi_head_latent_attention_to_hf(layer),
        tile_size=4,
    )
    assert bool(eqx.tree_equal(back, layer, typematch=True))


# ---------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------


def test_prefill_in_two_pieces_then_steps_equal_the_forward():
    layer = _layer(12)
    x = _x(20)
    full = np.asarray(_forward(layer, x))
    cache = layer.init_state(capacity=24)
    prefill = eqx.filter_jit(layer.extend)
    y1, cache, none = prefill(x[:8], cache, jnp.asarray(0))  # traced: one program
    y2, cache, _ = prefill(x[8:16], cache, jnp.asarray(8))
    assert none is None
    ys = [np.asarray(y1), np.asarray(y2)]
    step = eqx.filter_jit(layer.step)
    for t in range(16, 20):
        y_t, cache = step(x[t], cache, jnp.asarray(t))
        ys.append(np.asarray(y_t)[None])
    assert rel_err(np.concatenate(ys), full) <= 1e-5
    r = SIZES["kv_lora_rank"]
    c = jax.vmap(layer.kv_a_proj_with_mqa)(x)
    assert rel_err(cache.latent[:20], layer.kv_a_layernorm(c[:, :r])) <= 1e-6
    assert rel_err(cache.k_rot[:20], c[:, r:]) <= 1e-6


# Slow (6 s): the default run checks the layer's forward and gradients under cp = 4 with
# the latent ring, and its prefill on one device.
@pytest.mark.slow
@pytest.mark.parametrize("layout, kv_schedule", [("zigzag", "ring"), ("contiguous", "allgather")])
def test_prefill_context_parallel(layout, kv_schedule):
    # A prefill under cp = 4 after 8 tokens cached on one device: the outputs and the new
    # cache (gathered in sequence order on every rank) equal one device's.
    layer, cp = _layer(12), 4
    x = _x(40)
    prefill = eqx.filter_jit(lambda m, x, c, n: m.prefill(x, c, n))
    _, cache = prefill(layer, x[:8], layer.init_cache(48), 0)
    want, want_cache = prefill(layer, x[8:], cache, 8)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(layer, eqx.is_array)
    context = dcp.ContextParallel("cp", layout=LAYOUTS[layout])

    def local(params, x, cache):
        m = eqx.combine(params, static)
        return m.prefill(x, cache, 8, cp=context, kv_schedule=kv_schedule)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp"), P()), out_specs=(P("cp"), P()))
    new = LAYOUTS[layout].to_layout(x[8:], cp, axis=0)
    out, got = jax.jit(f)(params, jax.device_put(new, NamedSharding(mesh, P("cp"))), cache)
    assert rel_err(LAYOUTS[layout].from_layout(out, cp, axis=0), want) <= 1e-5
    assert rel_err(got.latent, want_cache.latent) <= 1e-6
    assert rel_err(got.k_rot, want_cache.k_rot) <= 1e-6


# ---------------------------------------------------------------------------------------
# Context parallelism: the latents exchanged
# ---------------------------------------------------------------------------------------


def _loss_weights(t: int):
    return jnp.cos(jnp.arange(t * HIDDEN, dtype=jnp.float32)).reshape(t, HIDDEN)


@ft.cache
def _one_device(q_lora_rank, t, docs):
    layer, x, w = _layer(q_lora_rank), _x(t), _loss_weights(t)
    cu = None if docs is None else jnp.asarray(docs, jnp.int32)

    params, static = eqx.partition(layer, eqx.is_array)

    def loss(params, x):
        out = eqx.combine(params, static)(x, cu_seqlens=cu)
        return jnp.sum(out * w), out

    (_, out), (g, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    return out, (g, dx)


def _cp(layer, x, w, cp: int, layout, kv_schedule: str, cu=None):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    x, w = layout.to_layout(x, cp, axis=0), layout.to_layout(w, cp, axis=0)
    params, static = eqx.partition(layer, eqx.is_array)
    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, x, w):
        out = eqx.combine(params, static)(x, cp=context, kv_schedule=kv_schedule, cu_seqlens=cu)
        return jax.lax.psum(jnp.sum(out * w), "cp"), out

    seq = P("cp")
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq), out_specs=(P(), seq))
    x, w = (jax.device_put(a, NamedSharding(mesh, seq)) for a in (x, w))
    (_, out), (g_params, dx) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(
        params, x, w
    )
    out, dx = layout.from_layout(out, cp, axis=0), layout.from_layout(dx, cp, axis=0)
    return out, eqx.combine(g_params, static), dx


def _check_cp(q_lora_rank, layout, kv_schedule, docs=None, t=32):
    want_out, (want_g, want_dx) = _one_device(q_lora_rank, t, docs)
    cu = None if docs is None else jnp.asarray(docs, jnp.int32)
    out, g, dx = _cp(
        _layer(q_lora_rank), _x(t), _loss_weights(t), 4, LAYOUTS[layout], kv_schedule, cu
    )
    assert rel_err(out, want_out) <= 1e-5
    assert rel_err(dx, want_dx) <= 1e-5
    errors = {
        jax.tree_util.keystr(path): rel_err(a, b)
        for (path, a), b in zip(
            jax.tree_util.tree_leaves_with_path(eqx.filter(g, eqx.is_array)),
            jax.tree.leaves(eqx.filter(want_g, eqx.is_array)),
        )
    }
    assert max(errors.values()) <= 1e-5, errors


DOCS = (0, 5, 5, 19, 32)  # an empty document, and boundaries inside tiles and pieces


@pytest.mark.parametrize(
    "layout, kv_schedule, docs",
    [("contiguous", "allgather", None), ("zigzag", "ring", DOCS)],
    ids=["contiguous-allgather", "zigzag-ring-documents"],
)
def test_context_parallel(layout, kv_schedule, docs):
    # cp = 4, tiles of 4: every zigzag piece (32 / 8 tokens) is one tile, every contiguous
    # shard two, so the schedules skip tiles and split diagonals on every rank. Each layout
    # and each schedule once here; every pair, with and without documents, in the grid.
    _check_cp(None, layout, kv_schedule, docs)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kv_schedule", ["allgather", "ring"])
@pytest.mark.parametrize("docs", [None, DOCS])
def test_context_parallel_grid(layout, kv_schedule, docs):
    _check_cp(12, layout, kv_schedule, docs)


def test_context_parallel_exchanges_latents():
    # The compiled forward's collectives (the loss's scalar all-reduce aside) move the
    # latents: (cp - 1) / cp * S * (kv_lora_rank + qk_rope_head_dim) float32 per rank,
    # under either schedule, where full keys and values would be
    # heads * (qk_head_dim + v_head_dim) = 2 * 15 per token against 12.
    layer, t, cp = _layer(), 32, 4
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(layer, eqx.is_array)
    latent = (cp - 1) * (t // cp) * (SIZES["kv_lora_rank"] + SIZES["qk_rope_head_dim"]) * 4
    for kv_schedule in ("allgather", "ring"):
        context = dcp.ContextParallel("cp", layout=dcp.Zigzag())

        def local(params, x, kv_schedule=kv_schedule):
            y = eqx.combine(params, static)(x, cp=context, kv_schedule=kv_schedule)
            return jax.lax.psum(jnp.sum(y), "cp")

        f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp")), out_specs=P())
        x = jax.device_put(_x(t), NamedSharding(mesh, P("cp")))
        text = jax.jit(f).lower(params, x).compile().as_text()
        assert text is not None
        kinds = ("all-gather", "collective-permute", "reduce-scatter", "all-to-all")
        received = dcp.internal.received_bytes_per_rank(text, kinds=kinds)
        assert received == {r: latent for r in range(cp)}, (kv_schedule, received)


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


def test_bad_arguments(without_runtime_typecheck):
    # The errors a user gets without jaxtyping's runtime checks (which catch some first).
    key = jr.key(0)
    with pytest.raises(ValueError, match="q_lora_rank"):
        MultiHeadLatentAttention(HIDDEN, HEADS, **SIZES, q_lora_rank=0, key=key)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MultiHeadLatentAttention(HIDDEN, HEADS, **{**SIZES, "kv_lora_rank": -1}, key=key)
    layer = _layer()
    with pytest.raises(ValueError, match="hidden_size = 16"):
        layer(jnp.zeros((8, HIDDEN + 1)))
    with pytest.raises(ValueError, match="vmap"):
        layer(jnp.zeros((2, 8, HIDDEN)))
    with pytest.raises(ValueError, match="no `state`"):
        layer(jnp.zeros((8, HIDDEN)), layer.init_cache(8))
    with pytest.raises(ValueError, match="capacity"):
        layer.init_state()
    with pytest.raises(ValueError, match="position"):
        layer.step(jnp.zeros(HIDDEN), layer.init_cache(8))
    wrong = LatentKVCache(latent=jnp.zeros((8, 3)), k_rot=jnp.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"`latent` \(capacity, 8\)"):
        layer.step(jnp.zeros(HIDDEN), wrong, 0)
    with pytest.raises(ValueError, match="tile_size=4 must divide the sequence length"):
        layer(jnp.zeros((6, HIDDEN)))
    with pytest.raises(ValueError, match="kv_schedule"):
        layer(jnp.zeros((8, HIDDEN)), kv_schedule="ringg")  # pyright: ignore[reportArgumentType]


def test_loader_errors():
    desc, weights, _ = _hf_fixture()
    config = desc["cases"]["plain"]
    prefix = config["weight_prefix"]
    with pytest.raises(ValueError, match="pass `prefix=`"):
        multi_head_latent_attention_from_hf(config, weights)
    with pytest.raises(ValueError, match="missing `kv_lora_rank`"):
        multi_head_latent_attention_from_hf(
            {k: v for k, v in config.items() if k != "kv_lora_rank"}, weights, prefix=prefix
        )
    with pytest.raises(ValueError, match="num_key_value_heads"):
        multi_head_latent_attention_from_hf(
            config | dict(num_key_value_heads=1), weights, prefix=prefix
        )
    with pytest.raises(ValueError, match="kv_b_proj.weight' has shape"):
        multi_head_latent_attention_from_hf(config | dict(v_head_dim=7), weights, prefix=prefix)
    with pytest.raises(ValueError, match=r"Unexpected tensor.*q_proj\.weight"):
        multi_head_latent_attention_from_hf(config | dict(q_lora_rank=4), weights, prefix=prefix)
    with pytest.raises(ValueError, match="Unexpected tensor"):
        multi_head_latent_attention_from_hf(
            config, weights | {prefix + "rotary_emb.inv_freq": np.zeros(2)}, prefix=prefix
        )

"""The hybrid model: softmax attention against numpy, and a CP-invariant training step."""

import functools as ft
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn import CausalSelfAttention, GatedDeltaNet, HybridLM

from .helpers import rel_err
from .test_layer import with_slow_decays


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def attention_reference(attn: CausalSelfAttention, x):
    """Causal softmax attention with half-split RoPE, float64 numpy."""
    x = np.asarray(x, np.float64)
    t, nh, hd = x.shape[0], attn.num_heads, attn.head_dim

    def proj(lin):
        return (x @ np.asarray(lin.weight, np.float64).T).reshape(t, nh, hd)

    q, k, v = proj(attn.q_proj), proj(attn.k_proj), proj(attn.v_proj)
    half = hd // 2
    inv_freq = attn.rope_theta ** (-np.arange(half) / half)
    ang = np.arange(t)[:, None, None] * inv_freq[None, None, :]

    def rope(y):
        y1, y2 = y[..., :half], y[..., half:]
        return np.concatenate(
            [y1 * np.cos(ang) - y2 * np.sin(ang), y2 * np.cos(ang) + y1 * np.sin(ang)], -1
        )

    q, k = rope(q), rope(k)
    out = np.zeros((t, nh, hd))
    for i in range(t):
        s = np.einsum("hd,khd->hk", q[i], k[: i + 1]) / np.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[i] = np.einsum("hk,khd->hd", p, v[: i + 1])
    return out.reshape(t, nh * hd) @ np.asarray(attn.o_proj.weight, np.float64).T


def test_attention_matches_numpy(getkey):
    attn = CausalSelfAttention(24, 3, 8, key=getkey())
    x = jr.normal(getkey(), (40, 24))
    out = eqx.filter_jit(lambda m, x: m(x))(attn, x)
    assert rel_err(out, attention_reference(attn, x)) <= 1e-5


def test_layer_pattern(getkey):
    model = eqx.filter_eval_shape(HybridLM, 16, 32, 8, key=getkey())
    kinds = [type(b.mixer) for b in model.blocks]
    assert kinds == [GatedDeltaNet] * 3 + [CausalSelfAttention] + [GatedDeltaNet] * 3 + [
        CausalSelfAttention
    ]


def _spy_block_sizes(monkeypatch) -> list:
    """The `block_size` of every `deltanet_cp.run` call a Gated DeltaNet layer makes."""
    from deltanet_cp.nn import _delta_layer

    seen, real = [], _delta_layer.run

    def spy(*args, **kwargs):
        seen.append(kwargs["block_size"])
        return real(*args, **kwargs)

    monkeypatch.setattr(_delta_layer, "run", spy)
    return seen


def test_block_and_tile_sizes_reach_the_layers(getkey, monkeypatch):
    """`block_size` is the Gated DeltaNet layers' engine block, handed to `deltanet_cp.run`
    (None: the backend's default); `tile_size` is the attention layers' score tile."""
    seen = _spy_block_sizes(monkeypatch)
    tokens = jnp.arange(24) % 16
    for block, tile in ((None, 128), (16, 4)):
        model = HybridLM(
            16,
            32,
            2,
            attention_every=2,
            chunk_size=8,
            block_size=block,
            tile_size=tile,
            key=getkey(),
        )
        gdn, attn = (b.mixer for b in model.blocks)
        assert isinstance(gdn, GatedDeltaNet) and isinstance(attn, CausalSelfAttention)
        assert (gdn.block_size, attn.tile_size) == (block, tile)
        seen.clear()
        assert bool(jnp.all(jnp.isfinite(model(tokens))))
        assert seen == [block]


def test_attention_precision_policy(getkey, without_runtime_typecheck):
    """On float32 parameters the attention layer's default policy (`None`) is `"highest"`,
    bit for bit: in `__call__`, `prefill` (and its cache) and `step`; HybridLM hands its
    `precision` to every token mixer."""
    key, x = getkey(), jr.normal(getkey(), (12, 32))
    results = {}
    for precision in (None, "highest"):
        attn = CausalSelfAttention(
            32, 4, 8, num_kv_heads=2, tile_size=4, key=key, precision=precision
        )
        assert attn.precision == precision
        cache = attn.init_cache(16)
        out, cache = eqx.filter_jit(lambda a, x, c: a.prefill(x, c, 0))(attn, x[:8], cache)
        step = eqx.filter_jit(lambda a, x, c: a.step(x, c, 8))(attn, x[8], cache)
        results[precision] = (eqx.filter_jit(lambda a, x: a(x))(attn, x), out, cache, step)
    for a, b in zip(jax.tree.leaves(results[None]), jax.tree.leaves(results["highest"])):
        np.testing.assert_array_equal(a, b)
    model = eqx.filter_eval_shape(
        HybridLM, 16, 32, 4, attention_every=2, precision="bfloat16", key=getkey()
    )
    assert model.precision == "bfloat16"
    assert [b.mixer.precision for b in model.blocks] == ["bfloat16"] * 4
    with pytest.raises(ValueError, match="`precision` must be one of"):
        CausalSelfAttention(32, 4, 8, precision="fp32", key=key)  # pyright: ignore[reportArgumentType]


B, T, VOCAB = 2, 32, 16


def _nll(logits, targets, mask):
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


@ft.cache
def _model() -> HybridLM:
    model = HybridLM(  # one Gated DeltaNet block and one attention block
        VOCAB,
        32,
        2,
        attention_every=2,
        num_key_heads=2,
        num_value_heads=4,
        key_head_dim=8,
        value_head_dim=8,
        num_attention_heads=2,
        attention_head_dim=8,
        intermediate_size=32,
        chunk_size=8,
        key=jr.key(0),
    )
    gdn = model.blocks[0].mixer
    assert isinstance(gdn, GatedDeltaNet)
    return eqx.tree_at(lambda m: m.blocks[0].mixer, model, with_slow_decays(gdn, jr.key(3)))


def _train_step(cp: int, layout: Any = dcp.Contiguous(), kv_schedule="allgather"):
    """The loss and gradients of one training step from a fixed model and batch; under
    zigzag the batch is put in zigzag order once and every layer runs on those shards."""
    model = _model()
    tokens = jr.randint(jr.key(1), (B, T + 1), 0, VOCAB)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = (jr.uniform(jr.key(2), (B, T)) < 0.7).astype(jnp.float32)
    params, static = eqx.partition(model, eqx.is_array)

    if cp == 1:

        def loss(params, inputs, targets, mask):
            m = eqx.combine(params, static)
            total, count = _nll(jax.vmap(m)(inputs), targets, mask)
            return total / count

    else:
        mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
        seq = P(None, "cp")

        def local(params, inputs, targets, mask):
            m = eqx.combine(params, static)
            context = dcp.ContextParallel("cp", layout=layout)
            call = ft.partial(m, cp=context, kv_schedule=kv_schedule)
            logits = jax.vmap(call)(inputs)
            total, count = _nll(logits, targets, mask)
            return jax.lax.psum(total, "cp") / jax.lax.psum(count, "cp")

        loss = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq, seq), out_specs=P())
        inputs, targets, mask = (layout.to_layout(a, cp) for a in (inputs, targets, mask))
        inputs, targets, mask = (
            jax.device_put(a, NamedSharding(mesh, seq)) for a in (inputs, targets, mask)
        )

    return jax.jit(jax.value_and_grad(loss))(params, inputs, targets, mask)


@ft.cache
def _reference_step():
    return _train_step(1)


@pytest.mark.parametrize("cp", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_train_step_is_cp_invariant(cp):
    loss1, grads1 = _reference_step()
    loss, grads = _train_step(cp)
    assert abs(float(loss) - float(loss1)) <= 1e-5 * abs(float(loss1))
    errs = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


@pytest.mark.parametrize(
    "cp, kv_schedule",
    [
        pytest.param(2, "ring", marks=pytest.mark.slow),
        (4, "allgather"),
        pytest.param(4, "ring", marks=pytest.mark.slow),
        pytest.param(2, "allgather", marks=pytest.mark.slow),
    ],
)
def test_train_step_on_zigzag_shards(cp, kv_schedule):
    # Every layer (Gated DeltaNet, its convolution, attention) on the same zigzag shards:
    # the loss and every gradient equal one device's from the same seed.
    loss1, grads1 = _reference_step()
    loss, grads = _train_step(cp, dcp.Zigzag(), kv_schedule)
    assert abs(float(loss) - float(loss1)) <= 1e-5 * abs(float(loss1))
    errs = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errs)) <= 1e-5, errs


def test_cp_with_a_mesh_is_refused(getkey):
    # The model runs inside the user's shard_map on this rank's shard: a ContextParallel
    # with a mesh (global arrays) is a clear error, not a silent wrong answer.
    model = _model()
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    tokens = jnp.zeros((T,), jnp.int32)
    with pytest.raises(ValueError, match="takes no `mesh`"):
        model(tokens, cp=dcp.ContextParallel("cp", mesh=mesh))

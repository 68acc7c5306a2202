"""The Qwen3.5 model: transformers' logits from its checkpoints (one file and sharded), context
parallel forward and training, prefill (from a cache, with state checkpoints, context
parallel) and decoding against the full forward, and the loader's errors.

The fixtures are tiny random `Qwen3_5ForCausalLM`s saved by transformers
(tests/data/make_qwen3_5_fixtures.py): `qwen3_5_lm` (untied head, layer types
[linear, linear, linear, full], one file) and `qwen3_5_lm_tied` (tied head, [linear, full,
linear, full], five shards and an index).
"""

import functools as ft
import json
import pathlib
import shutil
from collections import Counter

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

import deltanet_cp as dcp
from deltanet_cp.models import Qwen3_5Config, Qwen3_5ForCausalLM
from deltanet_cp.nn import CausalSelfAttention, GatedDeltaNet, KVCache, RecurrentLayerState

from .helpers import rel_err
from .test_layer import with_slow_decays


DATA = pathlib.Path(__file__).parent / "data"
IO = load_file(DATA / "qwen3_5_lm_io.safetensors")
MODELS = {"untied": "", "tied_sharded": "_tied"}
CHUNK = 8  # the Gated DeltaNet chunk size: the 48 fixture tokens are six chunks


@ft.cache
def _model(name: str = "untied") -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM.from_pretrained(DATA / f"qwen3_5_lm{MODELS[name]}", chunk_size=CHUNK)


@ft.cache
def _small() -> Qwen3_5ForCausalLM:
    """A random two-layer model ([linear, full], tied head) of the fixture's sizes, with slow
    decays and chunks of 4: quicker to compile, for the context-parallel tests."""
    fields = json.loads((DATA / "qwen3_5_lm" / "config.json").read_text())
    fields.update(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    fields["tie_word_embeddings"] = True
    model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf(fields), chunk_size=4, key=jr.key(0))
    gdn = model.layers[0].mixer
    assert isinstance(gdn, GatedDeltaNet)
    return eqx.tree_at(lambda m: m.layers[0].mixer, model, with_slow_decays(gdn, jr.key(1)))


def _tokens(name: str = "untied") -> jax.Array:
    return jnp.asarray(IO["tokens" + MODELS[name]])


def _max_abs(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


# ---------------------------------------------------------------------------------------
# Checkpoints and parity with transformers
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers(name):
    model = _model(name)
    assert model.config.tie_word_embeddings == (name == "tied_sharded")
    assert (model.lm_head is None) == model.config.tie_word_embeddings
    logits = _forward(model, _tokens(name))
    assert _max_abs(logits, IO["logits" + MODELS[name]]) <= 1e-4


def test_scanned_layers_match_transformers():
    # The layers stacked (tied fixture: [linear, full] twice, two groups) and scanned:
    # transformers' logits, and the loop's bit for bit.
    model = Qwen3_5ForCausalLM.from_pretrained(
        DATA / "qwen3_5_lm_tied", chunk_size=CHUNK, scan_layers=True
    )
    assert model.layers.num_groups == 2  # type: ignore[union-attr]
    logits = _forward(model, _tokens("tied_sharded"))
    assert _max_abs(logits, IO["logits_tied"]) <= 1e-4
    np.testing.assert_array_equal(logits, _forward(_model("tied_sharded"), _tokens("tied_sharded")))


def test_block_and_tile_sizes_reach_the_layers(monkeypatch):
    """`block_size` (the Gated DeltaNet layers' engine block, handed to `deltanet_cp.run`)
    and `tile_size` (the attention tile) are the loader's to choose: blocks of two chunks
    and tiles of 4 tokens give transformers' logits too."""
    from .test_hybrid import _spy_block_sizes

    seen = _spy_block_sizes(monkeypatch)
    model = Qwen3_5ForCausalLM.from_pretrained(
        DATA / "qwen3_5_lm", chunk_size=CHUNK, block_size=2 * CHUNK, tile_size=4
    )
    for layer in model.layers:
        mixer = layer.mixer
        if isinstance(mixer, GatedDeltaNet):
            assert mixer.block_size == 2 * CHUNK
        else:
            assert isinstance(mixer, CausalSelfAttention) and mixer.tile_size == 4
    logits = _forward(model, _tokens())
    assert seen == [2 * CHUNK] * 3
    assert _max_abs(logits, IO["logits"]) <= 1e-4
    assert [
        m.block_size
        for m in (layer.mixer for layer in _model().layers)
        if isinstance(m, GatedDeltaNet)
    ] == [None] * 3


def test_float32_default_precision_is_highest():
    """On float32 parameters the model's default policy (`None`) is `"highest"`, bit for
    bit, and every token mixer carries the model's `precision`."""
    model = Qwen3_5ForCausalLM.from_pretrained(
        DATA / "qwen3_5_lm", chunk_size=CHUNK, precision="highest"
    )
    assert model.precision == "highest" and _model().precision is None
    assert [layer.mixer.precision for layer in model.layers] == ["highest"] * 4
    np.testing.assert_array_equal(_forward(model, _tokens()), _forward(_model(), _tokens()))


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_model_matches_transformers(name):
    """bfloat16 parameters under the default policy (`"bfloat16"`), against transformers'
    float32 logits: within 8e-2 of their largest magnitude (twice transformers' own
    bfloat16 error on these checkpoints, 3.9e-2 and 2.4e-2 from its float32), and the same
    most likely next token at all but at most one of the 48 positions (transformers' own
    bfloat16: 48 and 47 of 48). `benchmarks/qwen3_5_bf16.py` measures both, and greedy
    decoding."""
    model = Qwen3_5ForCausalLM.from_pretrained(
        DATA / f"qwen3_5_lm{MODELS[name]}", chunk_size=CHUNK, dtype=jnp.bfloat16
    )
    logits = _forward(model, _tokens(name))
    assert logits.dtype == jnp.bfloat16
    ref = np.asarray(IO["logits" + MODELS[name]], np.float64)
    ours = np.asarray(logits.astype(jnp.float32), np.float64)
    assert np.abs(ours - ref).max() <= 8e-2 * np.abs(ref).max()
    assert np.sum(ours.argmax(-1) != ref.argmax(-1)) <= 1


def test_layer_pattern_and_config():
    kinds = [type(layer.mixer) for layer in _model("tied_sharded").layers]
    assert kinds == [GatedDeltaNet, CausalSelfAttention] * 2
    config = Qwen3_5Config.from_json(DATA / "qwen3_5_lm")
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.rotary_dim == 4 and config.num_key_value_heads == 2
    # Qwen3.5's default: full attention every 4th layer.
    fields = json.loads((DATA / "qwen3_5_lm" / "config.json").read_text())
    del fields["layer_types"]
    fields["num_hidden_layers"] = 8
    assert (
        Qwen3_5Config.from_hf({"text_config": fields}).layer_types
        == (("linear_attention",) * 3 + ("full_attention",)) * 2
    )
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        Qwen3_5Config.from_hf({**fields, "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="missing `vocab_size`"):
        Qwen3_5Config.from_hf({k: v for k, v in fields.items() if k != "vocab_size"})


# ---------------------------------------------------------------------------------------
# Context parallelism: forward and training
# ---------------------------------------------------------------------------------------


def _mesh(cp: int):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def _shard(x, mesh, layout, cp):
    return jax.device_put(layout.to_layout(x, cp, axis=0), NamedSharding(mesh, P("cp")))


CP_CASES = [
    pytest.param(4, dcp.Zigzag(), "ring", "allgather", id="cp4-zigzag-ring"),
    pytest.param(
        2,
        dcp.Contiguous(),
        "allgather",
        "ppermute",
        id="cp2-contiguous-allgather",
        marks=pytest.mark.slow,
    ),
    pytest.param(2, dcp.Zigzag(), "allgather", "ring", id="cp2-zigzag", marks=pytest.mark.slow),
    pytest.param(4, dcp.Contiguous(), "ring", "auto", id="cp4-contiguous", marks=pytest.mark.slow),
]


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("cp, layout, kv_schedule, exchange", CP_CASES)
def test_logits_context_parallel(cp, layout, kv_schedule, exchange):
    model, tokens = _model(), _tokens()
    mesh = _mesh(cp)
    params, static = eqx.partition(model, eqx.is_array)
    context = dcp.ContextParallel("cp", layout=layout, exchange=exchange)

    def local(params, tokens):
        m = eqx.combine(params, static)
        return m(tokens, cp=context, kv_schedule=kv_schedule)

    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp")), out_specs=P("cp"))
    logits = jax.jit(f)(params, _shard(tokens, mesh, layout, cp))
    logits = layout.from_layout(logits, cp, axis=0)
    assert _max_abs(logits, IO["logits"]) <= 1e-4


def _bfloat16(tree):
    """Every floating-point array of `tree` cast to bfloat16 (the guide's mixed precision)."""
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree)


def _train_step(cp: int, layout=dcp.Zigzag(), kv_schedule="allgather", mixed: bool = False):
    """Loss and gradients of the next-token loss over two sequences (the fixture's tokens
    and their reverse), the sequence sharded over `cp` ranks under `layout`. `mixed`: the
    float32 parameters cast to bfloat16 inside the loss (docs/guides/training_cp.md, "Mixed
    precision"), the gradients float32 through the cast."""
    model = _small()
    tokens = jnp.stack([_tokens(), _tokens()[::-1]])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    inputs, targets = jnp.pad(inputs, ((0, 0), (0, 1))), jnp.pad(targets, ((0, 0), (0, 1)))
    mask = jnp.ones(targets.shape, jnp.float32).at[:, -1].set(0)  # the padding position
    params, static = eqx.partition(model, eqx.is_array)
    compute = _bfloat16 if mixed else (lambda params: params)

    def nll(m, inputs, targets, mask, **cp_options):
        logits = jax.vmap(ft.partial(m, **cp_options))(inputs)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return -jnp.sum(picked * mask), jnp.sum(mask)

    if cp == 1:

        def loss(params, inputs, targets, mask):
            total, count = nll(eqx.combine(compute(params), static), inputs, targets, mask)
            return total / count

    else:
        mesh, seq = _mesh(cp), P(None, "cp")

        def local(params, inputs, targets, mask):
            m = eqx.combine(compute(params), static)
            context = dcp.ContextParallel("cp", layout=layout)
            total, count = nll(m, inputs, targets, mask, cp=context, kv_schedule=kv_schedule)
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


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "cp, kv_schedule",
    [(4, "allgather"), pytest.param(2, "ring", marks=pytest.mark.slow)],
)
def test_train_step_on_zigzag_shards(cp, kv_schedule):
    loss1, grads1 = _reference_step()
    loss, grads = _train_step(cp, dcp.Zigzag(), kv_schedule)
    assert abs(float(loss) - float(loss1)) <= 1e-5 * abs(float(loss1))
    errors = jax.tree.leaves(jax.tree.map(rel_err, grads, grads1))
    assert max(errors) <= 1e-4, errors


# ---------------------------------------------------------------------------------------
# Prefill and decoding
# ---------------------------------------------------------------------------------------


@eqx.filter_jit
def _prefill(model, tokens, cache=None, capacity=None, every=None):
    return model.prefill(tokens, cache, capacity=capacity, checkpoint_every=every)


def test_prefill_then_decode_equals_forward():
    # Every position's logits, 40 from the prefill and 8 one token at a time, equal the
    # forward's; the decoded ones also equal transformers' own cached decoding (its
    # recurrent kernels).
    model, tokens = _model(), _tokens()
    logits, cache = _prefill(model, tokens[:40], capacity=48)
    rows = []
    for token in tokens[40:]:
        step, cache = model.decode_step(token, cache)
        rows.append(step)
    assert int(cache.length) == 48
    assert rel_err(jnp.concatenate([logits, jnp.stack(rows)]), _forward(model, tokens)) <= 1e-5
    assert _max_abs(jnp.stack(rows), IO["decode_logits"]) <= 1e-4


@pytest.mark.usefixtures("fast_compile_one_test")
def test_decode_step_compiles_once(monkeypatch):
    # The decode step is traced once, then the compiled program is reused for every token.
    model, tokens = _model(), _tokens()
    traces = []
    step = GatedDeltaNet.step

    def counting(self, *args):
        traces.append(1)
        return step(self, *args)

    monkeypatch.setattr(GatedDeltaNet, "step", counting)
    _, cache = _prefill(model, tokens[:8], capacity=16)
    for token in tokens[8:14]:
        _, cache = model.decode_step(token, cache)
    assert len(traces) == 3  # one trace: the model's three Gated DeltaNet layers


def _assert_caches_close(got, want, tol=1e-5):
    assert int(got.length) == int(want.length)
    n = int(want.length)
    for a, b in zip(got.layers, want.layers):
        if isinstance(b, KVCache):
            assert isinstance(a, KVCache)
            assert rel_err(a.k[:n], b.k[:n]) <= tol and rel_err(a.v[:n], b.v[:n]) <= tol
        else:
            assert isinstance(a, RecurrentLayerState) and isinstance(b, RecurrentLayerState)
            assert rel_err(a.conv, b.conv) <= tol and rel_err(a.recurrent, b.recurrent) <= tol


@pytest.mark.usefixtures("fast_compile_one_test")
def test_prefill_from_cache_equals_whole_prefill():
    model, tokens = _model(), _tokens()
    want_logits, want = _prefill(model, tokens[:40], capacity=48)
    first, cache = _prefill(model, tokens[:8], capacity=48)
    second, cache = _prefill(model, tokens[8:40], cache)
    assert rel_err(jnp.concatenate([first, second]), want_logits) <= 1e-5
    _assert_caches_close(cache, want)


@pytest.mark.usefixtures("fast_compile_one_test")
def test_checkpoints_equal_prefix_states():
    # The states after 16 and 32 tokens, from one prefill of 40 (from a cache of 8): the
    # caches of those prefixes, and decoding on from a restored one is decoding on from
    # the prefix's own.
    model, tokens = _model(), _tokens()
    _, start = _prefill(model, tokens[:8], capacity=48)
    _, cache, ckpts = _prefill(model, tokens[8:40], start, every=16)
    np.testing.assert_array_equal(ckpts.lengths, [24, 40])
    for j, end in enumerate((24, 40)):
        _, prefix = _prefill(model, tokens[:end], capacity=48)
        restored = model.restore(cache, ckpts, j)
        _assert_caches_close(restored, prefix)
        got, _ = model.decode_step(tokens[end], restored)
        want, _ = model.decode_step(tokens[end], prefix)
        assert rel_err(got, want) <= 1e-5


def _cp_prefill(cp, layout, every):
    """The small model's prefill of 32 tokens after a cache of 8, sharded over `cp` ranks
    under `layout` (keys and values around a ring), compiled ahead of time: `(compiled,
    arguments)`; and one device's `(logits, cache, checkpoints)`."""
    model, tokens = _small(), _tokens()
    mesh = _mesh(cp)
    params, static = eqx.partition(model, eqx.is_array)
    _, start = _prefill(model, tokens[:8], capacity=48)

    def local(params, tokens, cache):
        m = eqx.combine(params, static)
        return m.prefill(
            tokens,
            cache,
            checkpoint_every=every,
            cp=dcp.ContextParallel("cp", layout=layout),
            kv_schedule="ring",
        )

    out_specs = (P("cp"), P()) if every is None else (P("cp"), P(), P("cp"))
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("cp"), P()), out_specs=out_specs)
    args = (params, _shard(tokens[8:40], mesh, layout, cp), start)
    return (
        jax.jit(f).lower(*args).compile(),
        args,
        _prefill(model, tokens[8:40], start, every=every),
    )


@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "cp, layout",
    [(4, dcp.Zigzag()), pytest.param(2, dcp.Contiguous(), marks=pytest.mark.slow)],
)
def test_context_parallel_prefill_equals_one_device(cp, layout):
    # From a cache of 8 tokens, 32 more sharded over cp ranks, checkpoints every 4 tokens:
    # logits, the new cache and the checkpoints equal one device's; and the compiled
    # program has the same collectives as the prefill without checkpoints (they come out
    # of the prefill's own pass).
    compiled, args, (want_logits, want, want_ckpts) = _cp_prefill(cp, layout, 4)
    logits, cache, ckpts = compiled(*args)
    logits = layout.from_layout(logits, cp, axis=0)
    ckpts = jax.tree.map(lambda a: layout.from_layout(a, cp, axis=0), ckpts)
    assert rel_err(logits, want_logits) <= 1e-5
    _assert_caches_close(cache, want)
    np.testing.assert_array_equal(ckpts.lengths, want_ckpts.lengths)
    for a, b in zip(ckpts.layers, want_ckpts.layers):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert rel_err(a.recurrent, b.recurrent) <= 1e-5 and rel_err(a.conv, b.conv) <= 1e-6
    without, _, _ = _cp_prefill(cp, layout, None)

    def collectives(c):
        return Counter((x.kind, x.shapes) for x in dcp.internal.collectives(c.as_text()))

    assert collectives(compiled) == collectives(without)
    assert sum(collectives(without).values()) > 0


@pytest.mark.usefixtures("fast_compile_one_test")
def test_generate_is_greedy():
    # Each generated token is the argmax of the forward's logits at the position before it.
    model, tokens = _model(), _tokens()
    out = model.generate(tokens[:43], 5)
    logits = _forward(model, jnp.concatenate([tokens[:43], out]))
    np.testing.assert_array_equal(out, jnp.argmax(logits[42:47], axis=-1))


# ---------------------------------------------------------------------------------------
# Loading: dtypes, the multimodal checkpoint's names, errors
# ---------------------------------------------------------------------------------------


def test_bfloat16_weights_float32_states():
    model = Qwen3_5ForCausalLM.from_pretrained(DATA / "qwen3_5_lm", dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {
        jnp.dtype(jnp.bfloat16)
    }
    logits, cache = _prefill(model, _tokens()[:16], capacity=24)
    assert logits.dtype == jnp.bfloat16
    gdn = [c for c in cache.layers if isinstance(c, RecurrentLayerState)]
    assert all(c.recurrent.dtype == jnp.float32 for c in gdn)
    assert rel_err(logits, IO["logits"][:16]) <= 5e-2


# The mixed step's gradients against the float32 step's, relative to the largest of them
# (`rel_err` over every parameter at once): measured 2.6e-2 here, and 0.4e-2 to 3.2e-2 over
# three random models of this shape and five token samples each. Rounding the parameters to
# bfloat16 and computing in float32 moves the gradients 0.3e-2 to 3.5e-2 on the same cases:
# the bound is set by the rounding of the parameters the recipe asks for, not by the
# bfloat16 products.
MIXED_GRAD_TOL = 5e-2


@pytest.mark.usefixtures("fast_compile_one_test")
def test_mixed_precision_training_step():
    # The guide's recipe (docs/guides/training_cp.md, "Mixed precision"): float32 master
    # weights cast to bfloat16 inside the loss, the logits cast to float32 before the cross
    # entropy, an AdamW step. The gradients come back float32 through the cast, near the
    # float32 step's (the reference of the context-parallel training test); the updated
    # weights and the moments stay float32. (That the recurrent states stay float32 under
    # bfloat16 parameters: test_bfloat16_weights_float32_states.)
    import optax

    loss, grads = _reference_step()
    mixed_loss, mixed_grads = _train_step(1, mixed=True)

    def flat(tree):
        return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])

    assert rel_err(flat(mixed_grads), flat(grads)) <= MIXED_GRAD_TOL
    assert abs(float(mixed_loss) - float(loss)) <= 1e-3 * float(loss)
    optimizer = optax.adamw(1e-3)
    params = eqx.filter(_small(), eqx.is_array)
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        updates, state = jax.jit(optimizer.update)(mixed_grads, optimizer.init(params), params)
        params = optax.apply_updates(params, updates)
    floats = [x for x in jax.tree.leaves((mixed_grads, params, state)) if x.dtype != jnp.int32]
    assert {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}


def _copy_checkpoint(tmp_path, rename=lambda n: n, drop=(), extra=None, reshape=()):
    """The untied fixture rewritten: tensors renamed, dropped, added or reshaped."""
    tensors = load_file(DATA / "qwen3_5_lm" / "model.safetensors")
    out = {rename(n): x for n, x in tensors.items() if n not in drop}
    for n in reshape:
        out[n] = out[n][..., :-1]
    out.update(extra or {})
    save_file(out, tmp_path / "model.safetensors")
    shutil.copy(DATA / "qwen3_5_lm" / "config.json", tmp_path / "config.json")
    return tmp_path


def test_multimodal_checkpoint_names(tmp_path):
    # Qwen3_5ForConditionalGeneration's names, with a vision tower and MTP weights skipped.
    def rename(n):
        return n.replace("model.", "model.language_model.", 1)

    extra = {"model.visual.patch.weight": np.ones(3, np.float32), "mtp.fc.weight": np.ones(2)}
    path = _copy_checkpoint(tmp_path, rename=rename, extra=extra)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({"text_config": config, "model_type": "qwen3_5"}))
    model = Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=CHUNK)
    assert eqx.tree_equal(model, _model())


def test_loader_names_every_problem(tmp_path):
    path = _copy_checkpoint(
        tmp_path,
        drop=("model.layers.1.linear_attn.A_log", "lm_head.weight"),
        extra={"model.layers.0.linear_attn.bogus": np.ones(2, np.float32)},
        reshape=("model.layers.3.self_attn.q_norm.weight",),
    )
    with pytest.raises(ValueError) as info:
        Qwen3_5ForCausalLM.from_pretrained(path)
    message = str(info.value)
    for name in (
        "2 missing",
        "model.layers.1.linear_attn.A_log",
        "lm_head.weight",
        "1 unexpected: model.layers.0.linear_attn.bogus",
        "1 misshapen: model.layers.3.self_attn.q_norm.weight: (15,), expected (16,)",
    ):
        assert name in message, message


def test_loader_refuses_pickle(tmp_path):
    shutil.copy(DATA / "qwen3_5_lm" / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pickle-based checkpoints are never read"):
        Qwen3_5ForCausalLM.from_pretrained(tmp_path)


def test_checkpoint_every_is_checked():
    model, tokens = _small(), _tokens()
    with pytest.raises(ValueError, match="multiple of the layer's chunk_size"):
        model.prefill(tokens[:16], checkpoint_every=6)
    mesh = _mesh(2)
    f = jax.shard_map(
        lambda t: model.prefill(
            t, checkpoint_every=4, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag())
        ),
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=(P("cp"), P(), P("cp")),
    )
    tokens = jax.ShapeDtypeStruct((24,), jnp.int32, sharding=NamedSharding(mesh, P("cp")))
    with pytest.raises(ValueError, match=r"must divide each contiguous piece .* \(6 tokens"):
        jax.jit(f).lower(tokens)


def test_cp_with_a_mesh_is_refused():
    # The model runs inside the user's shard_map on this rank's shard: a ContextParallel
    # with a mesh (global arrays) is refused by the forward and the prefill alike.
    model, tokens = _small(), _tokens()[:16]
    context = dcp.ContextParallel("cp", mesh=_mesh(2))
    with pytest.raises(ValueError, match="takes no `mesh`"):
        model(tokens, cp=context)
    with pytest.raises(ValueError, match="takes no `mesh`"):
        model.prefill(tokens, cp=context)

"""Hostile inputs to the models (`Qwen3_5ForCausalLM`, `HybridLM`), their configs and their
checkpoints: each is refused with a `ValueError` that names the argument (or the file, the
tensor, the config key) and says what to change, instead of a silently wrong result or an
error from deep inside.

A tiny random `Qwen3_5ForCausalLM` ([linear, full], vocabulary 64) and copies of the
fixtures of tests/data (see tests/test_qwen3_5.py) in temporary folders.
"""

import functools as ft
import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import pytest

from deltanet_cp.interop import gated_delta_net_from_hf, transformers as hf
from deltanet_cp.models import Qwen3_5Config, Qwen3_5ForCausalLM
from deltanet_cp.nn import HybridLM, KVCache, RecurrentLayerState


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


DATA = pathlib.Path(__file__).resolve().parent / "data"
FIELDS = json.loads((DATA / "qwen3_5_lm" / "config.json").read_text())
VOCAB = FIELDS["vocab_size"]
BAD_ID = rf"`tokens` must be ids in \[0, vocab_size = {VOCAB}\)"


def _config(**changes) -> Qwen3_5Config:
    fields = dict(FIELDS, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return Qwen3_5Config.from_hf({**fields, **changes})


@ft.cache
def _model(**changes) -> Qwen3_5ForCausalLM:
    return Qwen3_5ForCausalLM(_config(**changes), chunk_size=4, key=jr.key(0))


def _tokens(n: int = 8) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32) * 7 % VOCAB


# Set-up computations compiled as one program each (op by op, a model's forward compiles
# about two hundred small programs); the entry points under test are called as users call them.
@eqx.filter_jit
def _forward(model, tokens):
    return model(tokens)


@eqx.filter_jit
def _prefill(model, tokens, cache=None, capacity=None, every=None):
    return model.prefill(tokens, cache, capacity=capacity, checkpoint_every=every)


# ---------------------------------------------------------------------------------------
# 1. Token ids, at every entry point
# ---------------------------------------------------------------------------------------


def test_token_ids_are_checked_at_every_entry_point(without_runtime_typecheck):
    # Was: id V gave V - 1's logits and -1 wrapped, silently.
    model = _model()
    good = _tokens()
    assert model(good).shape == (8, VOCAB)
    _, cache = _prefill(model, good, capacity=16)
    for bad in [VOCAB, -1]:
        tokens = good.at[5].set(bad)
        with pytest.raises(ValueError, match=BAD_ID + rf"; got {bad} at position 5"):
            model(tokens)
        with pytest.raises(ValueError, match=BAD_ID):
            model.prefill(tokens)
        with pytest.raises(ValueError, match=BAD_ID):
            model.generate(tokens, 2)
        # A Python int is static under decode_step's `filter_jit`: refused when tracing.
        with pytest.raises(ValueError, match=rf"`token` must be ids in \[0, vocab_size = {VOCAB}"):
            model.decode_step(bad, cache)
        # Traced ids fail the computation when it runs.
        with pytest.raises(Exception, match=BAD_ID):
            jax.block_until_ready(_forward(model, tokens))
        with pytest.raises(Exception, match=BAD_ID):
            jax.block_until_ready(_prefill(model, tokens, capacity=16))
        with pytest.raises(Exception, match=rf"`token` must be ids in \[0, vocab_size = {VOCAB}"):
            jax.block_until_ready(model.decode_step(jnp.int32(bad), cache))
    with pytest.raises(ValueError, match="`tokens` must be a 1-D integer array"):
        model(good.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"`tokens` must be a 1-D integer array .*`jax.vmap`"):
        model.prefill(good.reshape(2, 4))
    with pytest.raises(ValueError, match="`token` must be one token id"):
        model.decode_step(good[:2], cache)


def test_hybrid_concrete_ids_raise_a_value_error():
    model = HybridLM(11, 16, 2, attention_every=2, chunk_size=4, key=jr.key(0))
    with pytest.raises(ValueError, match=r"`tokens` must be ids in \[0, vocab_size = 11\); got 11"):
        model(jnp.asarray([0, 11, 3], jnp.int32))


# ---------------------------------------------------------------------------------------
# 2. Typed config values and flags
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("tie_word_embeddings", "false", "`tie_word_embeddings` must be a bool"),
        ("tie_word_embeddings", 0, "`tie_word_embeddings` must be a bool"),
        ("attention_bias", "false", "`attention_bias` must be a bool"),
        ("hidden_size", True, "`hidden_size` must be an int"),
        ("hidden_size", 24.0, "`hidden_size` must be an int"),
        ("vocab_size", "64", "`vocab_size` must be an int"),
        ("num_attention_heads", 0, "`num_attention_heads` must be a positive int"),
        ("rms_norm_eps", "1e-6", "`rms_norm_eps` must be a number"),
        ("rms_norm_eps", float("nan"), "`rms_norm_eps` must be finite"),
        ("layer_types", "linear_attention", "`layer_types` must be a list"),
    ],
)
def test_config_values_are_typed(key, value, message, without_runtime_typecheck):
    with pytest.raises(ValueError, match=message):
        _config(**{key: value})


def test_config_numbers_and_files(tmp_path, without_runtime_typecheck):
    # An integral float field may be written as a JSON int; the types are normalised.
    config = _config(rms_norm_eps=0, rope_parameters={"rope_theta": 10000, "rope_type": "default"})
    assert type(config.rope_theta) is float and config.rope_theta == 1e4
    assert (
        config.tie_word_embeddings is False
        and _config(tie_word_embeddings=True).tie_word_embeddings
    )
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config\.json.* as JSON"):
        Qwen3_5Config.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**FIELDS, "tie_word_embeddings": "no"}))
    with pytest.raises(ValueError, match=r"config\.json.*`tie_word_embeddings` must be a bool"):
        Qwen3_5Config.from_json(tmp_path)


def test_transformers_flags_are_bools(without_runtime_typecheck):
    # Was: use_qk_l2norm_in_kernel="no" normalised.
    q = k = v = jnp.ones((1, 4, 1, 4))
    g = beta = jnp.zeros((1, 4, 1))
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match="`use_qk_l2norm_in_kernel` must be True or False"):
            fn(q, k, v, g, beta, use_qk_l2norm_in_kernel="no")  # pyright: ignore
        with pytest.raises(ValueError, match="`output_final_state` must be True or False"):
            fn(q, k, v, g, beta, output_final_state="yes")  # pyright: ignore
    with pytest.raises(ValueError, match="`use_qk_l2norm_in_kernel` must be True or False"):
        hf.chunk_kimi_delta_attention(q, k, v, q, beta, use_qk_l2norm_in_kernel="no")  # pyright: ignore


def test_layer_config_eps_is_a_number(without_runtime_typecheck):
    config = json.loads((DATA / "qwen3_5_gdn.json").read_text())
    with pytest.raises(ValueError, match="`rms_norm_eps` must be a number"):
        gated_delta_net_from_hf({**config, "rms_norm_eps": "1e-6"}, {})


# ---------------------------------------------------------------------------------------
# 3. A cache of another model
# ---------------------------------------------------------------------------------------


def test_cache_of_another_model_is_refused(without_runtime_typecheck):
    model, tokens = _model(), _tokens()
    _, cache = _prefill(model, tokens, capacity=16)
    token = tokens[0]
    one = _model(num_hidden_layers=1, layer_types=("full_attention",))
    _, other = _prefill(one, tokens, capacity=16)
    with pytest.raises(ValueError, match=r"`cache` has 1 layers; this model has 2"):
        model.decode_step(token, other)
    swapped = _model(layer_types=("full_attention", "linear_attention"))
    _, other = _prefill(swapped, tokens, capacity=16)
    with pytest.raises(ValueError, match=r"Layer 0 of this model is 'linear_attention'"):
        model.decode_step(token, other)
    wider = _model(linear_value_head_dim=16, head_dim=8)
    _, other = _prefill(wider, tokens, capacity=16)
    with pytest.raises(ValueError, match=r"`cache.layers\[0\]` \(linear_attention\) is"):
        model.decode_step(token, other)
    with pytest.raises(ValueError, match=r"`cache.layers\[0\]`"):
        model.prefill(tokens, other)
    as_ints = jax.tree.map(lambda a: a.astype(jnp.int32), cache)
    as_ints = eqx.tree_at(lambda c: c.length, as_ints, cache.length)
    with pytest.raises(ValueError, match=r"floating-point"):
        model.decode_step(token, as_ints)
    state = cache.layers[0]
    assert isinstance(state, RecurrentLayerState)
    half = eqx.tree_at(lambda c: c.layers[0].recurrent, cache, state.recurrent.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"`cache.layers\[0\].recurrent` has dtype float16"):
        model.decode_step(token, half)
    with pytest.raises(ValueError, match="`cache` must be a Qwen3_5Cache"):
        model.decode_step(token, cache.layers)  # pyright: ignore[reportArgumentType]
    batched = jax.tree.map(lambda a: a[None], cache)
    with pytest.raises(ValueError, match=r"`cache.length` must be a 0-d .*`jax.vmap`"):
        model.decode_step(token, batched)
    # A cache of this model in another dtype is fine.
    _, bf16 = model.decode_step(token, model.init_cache(16, jnp.bfloat16))
    kv = bf16.layers[1]
    assert isinstance(kv, KVCache) and kv.k.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------------------
# 4. restore: only a checkpoint
# ---------------------------------------------------------------------------------------


def test_restore_refuses_what_is_not_a_checkpoint(without_runtime_typecheck):
    # Was: restore(cache, ck, 100) returned the last checkpoint.
    model, tokens = _model(), _tokens(16)
    _, cache, ckpts = _prefill(model, tokens, capacity=24, every=4)
    assert int(model.restore(cache, ckpts, 2).length) == 12
    listed = r"4 checkpoint\(s\): 0 \(after 4 tokens\), 1 \(after 8 tokens\), 2 .*3 \(after 16"
    for index in [100, 4, -1]:
        with pytest.raises(ValueError, match=rf"`index` {index} is not a checkpoint; .*{listed}"):
            model.restore(cache, ckpts, index)
    with pytest.raises(ValueError, match=r"`index` must be an int"):
        model.restore(cache, ckpts, 1.0)  # pyright: ignore[reportArgumentType]
    restore = eqx.filter_jit(lambda m, c, k, i: m.restore(c, k, i).length)
    assert int(restore(model, cache, ckpts, jnp.int32(1))) == 8
    with pytest.raises(Exception, match=r"`index` must be one of 4 checkpoint\(s\)"):
        jax.block_until_ready(restore(model, cache, ckpts, jnp.int32(100)))
    _, early = _prefill(model, tokens[:6], capacity=24)
    with pytest.raises(ValueError, match="`cache` has seen 6 tokens, fewer than checkpoint 3's 16"):
        model.restore(early, ckpts, 3)
    other = _model(num_hidden_layers=1, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="`checkpoints` must be the Qwen3_5Checkpoints"):
        model.restore(cache, _prefill(other, tokens, every=4)[2], 0)


# ---------------------------------------------------------------------------------------
# 6. checkpoint_every and capacity
# ---------------------------------------------------------------------------------------


def test_checkpoint_every_longer_than_the_prompt(without_runtime_typecheck):
    # Was: a reshape TypeError from inside the engine.
    model, tokens = _model(), _tokens()
    with pytest.raises(ValueError, match=r"`checkpoint_every` \(96\) is more than the 8 tokens"):
        model.prefill(tokens, checkpoint_every=96)
    with pytest.raises(TypeError, match="`checkpoint_every` must be an int"):
        model.prefill(tokens, checkpoint_every=4.0)  # pyright: ignore


def test_default_capacity_leaves_room_to_decode(without_runtime_typecheck):
    # Was: the default capacity was the prompt's length, and the first decode_step failed.
    model, tokens = _model(), _tokens()
    _, cache = _prefill(model, tokens)
    assert cache.capacity == 8 + 256
    logits, cache = model.decode_step(tokens[0], cache)
    assert logits.shape == (VOCAB,) and int(cache.length) == 9
    _, full = _prefill(model, tokens, capacity=8)
    with pytest.raises(Exception, match=r"The cache is full: it holds 8 tokens.*capacity="):
        jax.block_until_ready(model.decode_step(tokens[0], full))


def test_prefill_needs_room_in_its_cache(without_runtime_typecheck):
    # Was: a prefill past the cache's end silently overwrote its last entries.
    model, tokens = _model(), _tokens()
    _, cache = _prefill(model, tokens[:6], capacity=10)
    with pytest.raises(ValueError, match=r"`cache` has no room for `tokens`: .* 10 tokens, 6 seen"):
        model.prefill(tokens, cache)
    with pytest.raises(Exception, match=r"`cache` has no room for `tokens` \(8 tokens\)"):
        jax.block_until_ready(_prefill(model, tokens, cache))
    with pytest.raises(ValueError, match="`capacity` is for a new cache"):
        model.prefill(tokens[:2], cache, capacity=32)
    with pytest.raises(ValueError, match=r"`capacity` \(4\) is less than the prompt's 8 tokens"):
        model.prefill(tokens, capacity=4)
    with pytest.raises(ValueError, match="`capacity` must be a positive int"):
        model.init_cache(0)


# ---------------------------------------------------------------------------------------
# 8. Empty prompts and batches
# ---------------------------------------------------------------------------------------


def test_empty_prompts_and_batches(without_runtime_typecheck):
    model = _model()
    empty = jnp.zeros((0,), jnp.int32)
    logits = model(empty)
    assert logits.shape == (0, VOCAB) and logits.dtype == model.embed.weight.dtype
    hidden, stats = model.hidden_states(empty)
    assert hidden.shape == (0, model.config.hidden_size) and stats is None
    with pytest.raises(ValueError, match="`tokens` is empty: `prefill` needs at least one"):
        model.prefill(empty)
    with pytest.raises(ValueError, match="`tokens` is empty: `generate` needs a prompt"):
        model.generate(empty, 3)
    with pytest.raises(ValueError, match="`max_new_tokens` must be at least 0"):
        model.generate(_tokens(), -1)
    assert jax.vmap(model)(jnp.zeros((0, 8), jnp.int32)).shape == (0, 8, VOCAB)
    hybrid = HybridLM(11, 16, 2, attention_every=2, chunk_size=4, key=jr.key(0))
    assert hybrid(empty).shape == (0, 11)


# ---------------------------------------------------------------------------------------
# 5 and 7. Checkpoint files: confined to the folder, corrupt ones named
# ---------------------------------------------------------------------------------------


def _sharded(tmp_path) -> pathlib.Path:
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / "qwen3_5_lm_tied", path)
    return path


def _point(path: pathlib.Path, name: str, file: object) -> None:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


NAME = "model.layers.0.linear_attn.A_log"


def test_index_entries_stay_in_the_checkpoint_folder(tmp_path):
    # Was: `../other/model.safetensors` and absolute paths were followed.
    outside = tmp_path / "other"
    outside.mkdir()
    shard = json.loads((DATA / "qwen3_5_lm_tied" / "model.safetensors.index.json").read_text())[
        "weight_map"
    ][NAME]
    shutil.copy(DATA / "qwen3_5_lm_tied" / shard, outside / "model.safetensors")
    for file in [
        "../other/model.safetensors",
        str(outside / "model.safetensors"),
        "sub/../../other/model.safetensors",
        "sub/model.safetensors",
        "..",
    ]:
        path = _sharded(tmp_path)
        (path / "sub").mkdir()
        shutil.copy(outside / "model.safetensors", path / "sub" / "model.safetensors")
        _point(path, NAME, file)
        with pytest.raises(ValueError, match=rf"puts '{NAME}' in '{file}'.*checkpoint folder"):
            Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)
        config = json.loads((DATA / "qwen3_5_gdn.json").read_text())
        with pytest.raises(ValueError, match=rf"puts '{NAME}' in '{file}'"):
            gated_delta_net_from_hf(config, path / "model.safetensors.index.json")
        shutil.rmtree(path)
    # The names are confined, not the files: a file in the folder may link out of it (as the
    # Hugging Face cache's do; see test_hugging_face_cache_layout_is_read). Was: refused.
    path = _sharded(tmp_path)
    (path / "link.safetensors").symlink_to(outside / "model.safetensors")
    _point(path, NAME, "link.safetensors")
    expected = Qwen3_5ForCausalLM.from_pretrained(DATA / "qwen3_5_lm_tied", chunk_size=4)
    assert eqx.tree_equal(Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4), expected)
    shutil.rmtree(path)
    path = _sharded(tmp_path)
    _point(path, NAME, 3)
    with pytest.raises(ValueError, match=rf"maps '{NAME}' to 3"):
        Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)


def _hub_cache(tmp_path, folder: pathlib.Path) -> pathlib.Path:
    """`folder` as `huggingface_hub.snapshot_download` leaves it: every file a relative link
    `snapshots/<rev>/<name> -> ../../blobs/<sha>`; returns the snapshot folder."""
    repo = tmp_path / "hub" / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(folder.iterdir())):
        blob = f"{i:040x}"
        shutil.copy(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(pathlib.Path("..", "..", "blobs", blob))
    return snapshot


def test_hugging_face_cache_layout_is_read(tmp_path):
    # Was: every shard of a sharded snapshot refused as a "link out of the folder", while a
    # single `model.safetensors` linking anywhere was read. One rule now: names confined,
    # files in the folder followed wherever they link.
    sharded = _hub_cache(tmp_path / "sharded", DATA / "qwen3_5_lm_tied")
    assert (sharded / "model-00001-of-00005.safetensors").is_symlink()
    model = Qwen3_5ForCausalLM.from_pretrained(sharded, chunk_size=4)
    assert eqx.tree_equal(
        model, Qwen3_5ForCausalLM.from_pretrained(DATA / "qwen3_5_lm_tied", chunk_size=4)
    )
    config = json.loads((sharded / "config.json").read_text())
    prefix = "model.layers.0.linear_attn."
    expected = gated_delta_net_from_hf(config, DATA / "qwen3_5_lm_tied", prefix=prefix)
    for weights in (sharded, sharded / "model.safetensors.index.json"):
        assert eqx.tree_equal(gated_delta_net_from_hf(config, weights, prefix=prefix), expected)
    single = _hub_cache(tmp_path / "single", DATA / "qwen3_5_lm")
    config = json.loads((single / "config.json").read_text())
    expected = gated_delta_net_from_hf(
        config, DATA / "qwen3_5_lm" / "model.safetensors", prefix=prefix
    )
    for weights in (single, single / "model.safetensors"):
        assert eqx.tree_equal(gated_delta_net_from_hf(config, weights, prefix=prefix), expected)


def test_corrupt_safetensors_are_named(tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(DATA / "qwen3_5_lm", path)
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])  # truncated: the last tensor's bytes cut
    with pytest.raises(ValueError, match=r"Tensor '.*' of the safetensors file '.*model\.safet"):
        Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)
    file.write_bytes(data[:8] + b"{garbage" + data[16:])
    with pytest.raises(ValueError, match=r"safetensors file '.*model\.safetensors' is corrupt"):
        Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)
    file.write_bytes(b"\x01")
    with pytest.raises(ValueError, match=r"'.*model\.safetensors' is corrupt"):
        Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)
    # The layer loader (the same reader) names the file too.
    config = json.loads((DATA / "qwen3_5_gdn.json").read_text())
    layer = tmp_path / "layer.safetensors"
    layer.write_bytes((DATA / "qwen3_5_gdn.safetensors").read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"safetensors file '.*layer\.safetensors'"):
        gated_delta_net_from_hf(config, layer)
    layer.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"safetensors file '.*layer\.safetensors'"):
        gated_delta_net_from_hf(config, layer)


def test_overlapping_safetensors_ranges_are_refused(tmp_path):
    # Two tensors over one byte range (the `safetensors` package's loader refuses such a
    # file; reading it would silently give both the same values).
    import struct

    from deltanet_cp.interop._checkpoint import read_header

    def write(offsets):
        header = {
            name: {"dtype": "F32", "shape": [2], "data_offsets": list(span)}
            for name, span in offsets.items()
        }
        text = json.dumps(header).encode()
        file = tmp_path / "x.safetensors"
        file.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
        return file

    assert set(read_header(write({"a": (0, 8), "b": (8, 16)}))) == {"a", "b"}
    with pytest.raises(ValueError, match="'a' and 'b' share bytes"):
        read_header(write({"a": (0, 8), "b": (4, 12)}))
    with pytest.raises(ValueError, match="belong to no tensor"):
        read_header(write({"a": (0, 8), "b": (12, 20)}))


def _raw_safetensors(file: pathlib.Path, header: object, data: bytes = bytes(8)) -> None:
    import struct

    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_safetensors_headers_that_are_not_objects_are_named(tmp_path):
    # Was: `AttributeError: 'list' object has no attribute 'items'` from `from_pretrained`.
    path = tmp_path / "ckpt"
    path.mkdir()
    shutil.copy(DATA / "qwen3_5_lm" / "config.json", path / "config.json")
    config = json.loads((DATA / "qwen3_5_gdn.json").read_text())
    for header in ([1, 2], "text", 3, None):
        _raw_safetensors(path / "model.safetensors", header)
        match = r"'.*model\.safetensors' is corrupt \(its header is a JSON \w+, not an object"
        with pytest.raises(ValueError, match=match):
            Qwen3_5ForCausalLM.from_pretrained(path, chunk_size=4)
        with pytest.raises(ValueError, match=match):
            gated_delta_net_from_hf(config, path / "model.safetensors")


def test_negative_data_offsets_are_named(tmp_path):
    # Was: "tensors None and 'a' share bytes".
    file = tmp_path / "model.safetensors"
    shutil.copy(DATA / "qwen3_5_lm" / "config.json", tmp_path / "config.json")
    config = json.loads((DATA / "qwen3_5_gdn.json").read_text())
    for offsets in ([-8, 0], [0, -8], [8, 0], [0], [0.0, 8]):
        _raw_safetensors(file, {"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets}})
        match = rf"Tensor 'a' of the safetensors file '.*' has data_offsets \[{offsets[0]}"
        with pytest.raises(ValueError, match=match):
            Qwen3_5ForCausalLM.from_pretrained(tmp_path, chunk_size=4)
        with pytest.raises(ValueError, match=match):
            gated_delta_net_from_hf(config, file)

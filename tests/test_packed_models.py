"""Packed documents through every model (`cu_seqlens=`): the logits of a packed row equal
each document run alone through the same model, and the gradient of a packed loss equals
the sum of the documents' losses' gradients; on one device, and (slow) under context
parallelism in both layouts with documents crossing the ranks' boundaries, experts split.

One shared packed fixture: five documents of 5, 14, 13, 11 and 21 tokens packed by
`deltanet_cp.data.pack_documents` into two rows of 32 (`[0, 5, 19, 32, 32]` and
`[0, 11, 32, 32, 32]`: one width, padded by repeating 32). At cp = 4 (contiguous) the
ranks hold 8 tokens each, so the second document crosses two boundaries and the third one;
at cp = 2 (zigzag) the first rank holds tokens 0-7 and 24-31. The models are the smallest
of their test modules: two layers ([linear, full]) of the fixtures' sizes (Kimi Linear: its
test fixture of three, KDA, latent attention, KDA).
"""

import functools as ft
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.data import pack_documents, real_tokens
from deltanet_cp.models import (
    KimiLinearForCausalLM,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from deltanet_cp.nn import (
    CausalSelfAttention,
    expert_partition_specs,
    GatedDeltaNet,
    HybridLM,
    KimiDeltaAttention,
)

from .helpers import rel_err
from .test_layer import with_slow_decays


DATA = pathlib.Path(__file__).parent / "data"
LENGTHS = (5, 14, 13, 11, 21)
ROW = 32
VOCAB = 64  # every model's here
TWO_LAYERS = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}


def _qwen(cls, config_cls, folder: str, **changes):
    fields = json.loads((DATA / folder / "config.json").read_text())
    fields.update(TWO_LAYERS, **changes)
    model = cls(config_cls.from_hf(fields), chunk_size=4, key=jr.key(0))
    gdn = model.layers[0].mixer
    assert isinstance(gdn, GatedDeltaNet)
    return eqx.tree_at(lambda m: m.layers[0].mixer, model, with_slow_decays(gdn, jr.key(1)))


def _hybrid():
    model = HybridLM(  # test_hybrid's: one Gated DeltaNet block and one attention block
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


def _kimi():
    # The mixed fixture (KDA, latent attention, KDA; layers 1 and 2 sparse), the KDA
    # layers' decay rates spread log-uniformly over [0.02, 2] so the state carries.
    model = KimiLinearForCausalLM.from_pretrained(DATA / "kimi_linear_mixed", chunk_size=4)
    for i in (0, 2):
        kda = model.layers[i].mixer
        assert isinstance(kda, KimiDeltaAttention)
        h = kda.num_heads
        a_log = jnp.linspace(jnp.log(0.02), jnp.log(2.0), h)
        slow = eqx.tree_at(
            lambda m: (m.A_log, m.dt_bias), kda, (a_log, -jnp.ones_like(kda.dt_bias))
        )
        model = eqx.tree_at(lambda m: m.layers[i].mixer, model, slow)
    return model


BUILDERS = {
    "qwen3_5": lambda: _qwen(Qwen3_5ForCausalLM, Qwen3_5Config, "qwen3_5_lm"),
    # Layer 1 is sparse (the fixture's `mlp_only_layers=[1]` dropped).
    "qwen3_next": lambda: _qwen(
        Qwen3NextForCausalLM, Qwen3NextConfig, "qwen3_next_moe", mlp_only_layers=[]
    ),
    "qwen3_5_moe": lambda: _qwen(Qwen3_5MoeForCausalLM, Qwen3_5MoeConfig, "qwen3_5_moe"),
    "hybrid": _hybrid,
    "kimi_linear": _kimi,
}
MOE = ("qwen3_next", "qwen3_5_moe")


@ft.cache
def _model(name: str):
    return BUILDERS[name]()


@ft.cache
def _packed():
    """The shared packed fixture: `PackedRows` of two rows, and the documents."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, VOCAB, n).astype(np.int32) for n in LENGTHS]
    rows = pack_documents(docs, ROW)
    np.testing.assert_array_equal(rows.cu_seqlens, [[0, 5, 19, 32, 32], [0, 11, 32, 32, 32]])
    return rows, docs


def _call(model, tokens, cu_seqlens=None, **kwargs):
    """`(logits, router stats or None)`."""
    if isinstance(model, HybridLM):
        assert kwargs.pop("expert_axis", None) is None
        return model(tokens, cu_seqlens=cu_seqlens, **kwargs), None
    if any(model.config.is_sparse(i) for i in range(len(model.layers))):
        return model.logits_and_router_stats(tokens, cu_seqlens=cu_seqlens, **kwargs)
    return model(tokens, cu_seqlens=cu_seqlens, **kwargs), None


def _nll_sum(logits, labels):
    """The summed cross entropy over the targets that are not -100."""
    real = labels != -100
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, jnp.where(real, labels, 0)[..., None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(real, picked, 0.0))


def _doc_labels(doc):
    return jnp.asarray(np.append(doc[1:], -100), jnp.int32)


@ft.cache
def _alone(name: str, row: int = 0):
    """Each document of `row` run alone, concatenated: `(logits, summed stats)`, and the
    gradient of the sum of the documents' losses."""
    model = _model(name)
    rows, docs = _packed()
    mine = [docs[i] for i in rows.document_ids[row] if i >= 0]
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params):
        m = eqx.combine(params, static)
        outs = [_call(m, jnp.asarray(d)) for d in mine]
        total = sum(_nll_sum(logits, _doc_labels(d)) for (logits, _), d in zip(outs, mine))
        logits = jnp.concatenate([o[0] for o in outs])
        stats = (
            None if outs[0][1] is None else jax.tree.map(lambda *a: sum(a), *(o[1] for o in outs))
        )
        return total, (logits, stats)

    (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return logits, stats, grads


def _packed_step(
    name,
    cp: int = 1,
    layout: dcp.AbstractLayout = dcp.Contiguous(),
    kv_schedule="allgather",
    expert_axis=None,
):
    """The packed row 0 through the model: `(logits, stats)` and the gradient of its
    summed loss, on one device or sharded over `cp` ranks under `layout`."""
    model = _model(name)
    rows, _ = _packed()
    tokens, labels = jnp.asarray(rows.tokens[0]), jnp.asarray(rows.labels[0])
    cu = jnp.asarray(rows.cu_seqlens[0])
    params, static = eqx.partition(model, eqx.is_array)
    if cp == 1:

        def one(params):
            logits, stats = _call(eqx.combine(params, static), tokens, cu)
            return _nll_sum(logits, labels), (logits, stats)

        (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(one, has_aux=True))(params)
        return logits, stats, grads
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    context = dcp.ContextParallel("cp", layout=layout)
    if expert_axis is None:
        specs = jax.tree.map(lambda _: P(), params)
    else:
        specs = expert_partition_specs(params, expert_axis)

    def local(params, tokens, labels, cu):
        m = eqx.combine(params, static)
        logits, stats = _call(
            m, tokens, cu, cp=context, kv_schedule=kv_schedule, expert_axis=expert_axis
        )
        total = jax.lax.psum(_nll_sum(logits, labels), "cp")
        stats = None if stats is None else jax.lax.psum(stats, "cp")
        return total, (logits, stats)

    def loss(params, tokens, labels, cu):
        out_specs = (P(), (P("cp"), P()))
        return jax.shard_map(
            local, mesh=mesh, in_specs=(specs, P("cp"), P("cp"), P()), out_specs=out_specs
        )(params, tokens, labels, cu)

    shard = NamedSharding(mesh, P("cp"))
    tokens, labels = (
        jax.device_put(layout.to_layout(a, cp, axis=0), shard) for a in (tokens, labels)
    )
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    (_, (logits, stats)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params, tokens, labels, cu
    )
    return layout.from_layout(logits, cp, axis=0), stats, grads


def _check(name, got, want):
    logits, stats, grads = got
    logits1, stats1, grads1 = want
    assert rel_err(logits, logits1) <= 1e-5
    if stats1 is not None:
        # The router's sums over the packed row are the documents' sums.
        assert max(jax.tree.leaves(jax.tree.map(rel_err, stats, stats1))) <= 1e-5
    errors = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-4, errors


# The default run checks the MoE model (Gated DeltaNet, attention and routed experts through
# the models' one forward); the other models and HybridLM run in the slow suite.
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=() if name == "qwen3_5_moe" else pytest.mark.slow)
        for name in BUILDERS
    ],
)
def test_packed_equals_documents_alone(name):
    _check(name, _packed_step(name), _alone(name))


CP_CASES = [
    pytest.param(2, dcp.Zigzag(), "ring", None, id="cp2-zigzag-ring"),
    pytest.param(4, dcp.Contiguous(), "allgather", None, id="cp4-contiguous-allgather"),
]


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("cp, layout, kv_schedule, experts", CP_CASES)
@pytest.mark.parametrize("name", list(BUILDERS))
def test_packed_context_parallel(name, cp, layout, kv_schedule, experts):
    _check(name, _packed_step(name, cp, layout, kv_schedule, experts), _alone(name))


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("cp, layout", [(4, dcp.Zigzag()), (2, dcp.Contiguous())])
def test_packed_with_experts_split(cp, layout):
    # The 8 experts split over the context axis, the routing summed over the ranks.
    got = _packed_step("qwen3_5_moe", cp, layout, "allgather", "cp")
    _check("qwen3_5_moe", got, _alone("qwen3_5_moe"))


@pytest.mark.usefixtures("fast_compile_one_test")
def test_batch_of_rows_is_a_vmap():
    # Rows with their own documents, `cu_seqlens` padded to one width by repeating 32.
    model = _model("hybrid")
    rows, _ = _packed()
    logits = eqx.filter_jit(jax.vmap(lambda m, t, cu: m(t, cu_seqlens=cu), (None, 0, 0)))(
        model, jnp.asarray(rows.tokens), jnp.asarray(rows.cu_seqlens)
    )
    docs = _packed()[1]
    for row in range(2):
        mine = [docs[i] for i in rows.document_ids[row] if i >= 0]
        alone = eqx.filter_jit(lambda m: jnp.concatenate([m(jnp.asarray(d)) for d in mine]))
        assert rel_err(logits[row], alone(model)) <= 1e-5


@pytest.mark.usefixtures("fast_compile_one_test")
def test_router_stats_count_real_tokens_only():
    # Row 0's three documents (32 tokens) packed into a row of 40: with the row's real
    # tokens as `token_mask`, the routing's sums are the documents' alone (the 8 padding
    # tokens are routed, but not counted), as transformers' attention mask does.
    model = _model("qwen3_5_moe")
    _, docs = _packed()
    padded = pack_documents(docs[:3], 40)
    np.testing.assert_array_equal(padded.cu_seqlens, [[0, 5, 19, 32, 40]])
    mask = real_tokens(padded)[0]
    assert int(mask.sum()) == 32 and not bool(mask[32:].any())
    run = eqx.filter_jit(
        lambda m, t, cu, mask: m.logits_and_router_stats(t, cu_seqlens=cu, token_mask=mask)
    )
    cu = jnp.asarray(padded.cu_seqlens[0])
    logits, stats = run(model, jnp.asarray(padded.tokens[0]), cu, mask)
    want_logits, want, _ = _alone("qwen3_5_moe")
    assert rel_err(logits[:32], want_logits) <= 1e-5
    np.testing.assert_array_equal(stats.counts, want.counts)
    assert float(stats.tokens) == float(want.tokens) == 32 * 2  # two sparse layers
    assert rel_err(stats.probabilities, want.probabilities) <= 1e-6


@pytest.mark.usefixtures("fast_compile_one_test")
def test_rows_over_a_data_axis_without_context_parallelism():
    # Inside shard_map over "dp" only, each rank's `cu_seqlens` differ (they vary over
    # "dp"): the check on their values must take that (it did not: equinox's `error_if`
    # refused an operand varying over a mesh axis).
    layer = CausalSelfAttention(8, 1, 4, tile_size=4, key=jr.key(0))
    x = jr.normal(jr.key(1), (2, 8, 8))
    cu = jnp.asarray([[0, 3, 8], [0, 5, 8]], jnp.int32)
    mesh = jax.make_mesh((2,), ("dp",), devices=jax.devices()[:2])
    rows = NamedSharding(mesh, P("dp"))
    run = jax.jit(
        jax.shard_map(
            lambda x, cu: layer(x[0], cu_seqlens=cu[0])[None],
            mesh=mesh,
            in_specs=(P("dp"), P("dp")),
            out_specs=P("dp"),
        )
    )
    got = run(jax.device_put(x, rows), jax.device_put(cu, rows))
    want = jax.jit(jax.vmap(lambda x, cu: layer(x, cu_seqlens=cu)))(x, cu)
    assert rel_err(np.asarray(got), want) <= 1e-6
    bad = jnp.asarray([[0, 3, 8], [0, 9, 8]], jnp.int32)
    with pytest.raises(Exception, match="must start at 0, not decrease"):
        jax.block_until_ready(run(jax.device_put(x, rows), jax.device_put(bad, rows)))


def _nan_step(name, cp: int, layout: dcp.AbstractLayout, expert_axis=None):
    """Row 0's three documents (`[0, 5, 19, 32]`) with unique token ids, through the model
    sharded over `cp` ranks: a function of the embedding table giving the logits (in
    sequence order) and the gradient, with respect to the table, of the loss over the
    first and last documents (the middle one's labels are -100)."""
    model = _model(name)
    rows, _ = _packed()
    cu = jnp.asarray(rows.cu_seqlens[0, :4])
    tokens = jnp.arange(ROW, dtype=jnp.int32)  # one id per position: per-token gradients
    labels = jnp.where((tokens >= 5) & (tokens < 19), -100, (tokens * 7) % VOCAB)
    params, static = eqx.partition(model, eqx.is_array)  # the table is replaced in `local`
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    context = dcp.ContextParallel("cp", layout=layout)
    specs = (
        jax.tree.map(lambda _: P(), params)
        if expert_axis is None
        else expert_partition_specs(params, expert_axis)
    )

    def local(table, params, tokens, labels):
        m = eqx.combine(eqx.tree_at(lambda m: m.embed.weight, params, table), static)
        kwargs = {} if expert_axis is None else {"expert_axis": expert_axis}
        logits, _ = _call(m, tokens, cu, cp=context, **kwargs)
        return jax.lax.psum(_nll_sum(logits, labels), "cp"), logits

    def loss(table, params, tokens, labels):
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), specs, P("cp"), P("cp")),
            out_specs=(P(), P("cp")),
        )(table, params, tokens, labels)

    shard = NamedSharding(mesh, P("cp"))
    tokens, labels = (
        jax.device_put(layout.to_layout(a, cp, axis=0), shard) for a in (tokens, labels)
    )
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    grad = jax.jit(jax.grad(loss, has_aux=True))

    def run(table):
        g, logits = grad(table, params, tokens, labels)
        return np.asarray(layout.from_layout(logits, cp, axis=0)), np.asarray(g)

    return model.embed.weight, run


def _check_nan_stays_in_its_document(name, cp, layout, expert_axis=None):
    # A NaN in one embedding of the middle document (position 11): the other documents'
    # logits and the gradients at their tokens are finite and those of the clean run. (The
    # middle document's own gradients may be NaN before position 11 too: reverse mode
    # multiplies its zero cotangents by the NaN, as through any recurrence.)
    table, run = _nan_step(name, cp, layout, expert_axis)
    clean_logits, clean_grads = run(table)
    logits, grads = run(table.at[11].set(jnp.nan))
    other = np.r_[0:5, 19:32]
    assert np.isnan(logits[11]).all()
    assert np.isfinite(logits[other]).all() and np.isfinite(grads[other]).all()
    assert rel_err(logits[other], clean_logits[other]) <= 1e-6
    assert rel_err(grads[other], clean_grads[other]) <= 1e-5


@pytest.mark.usefixtures("fast_compile_one_test")
def test_nan_stays_in_its_document_gated_delta_net_layer():
    # The cheap case of the model tests below: one Gated DeltaNet layer (its convolution and
    # recurrence) at cp = 4, zigzag, the documents [0, 5, 19, 32] crossing the ranks.
    layer = _model("hybrid").blocks[0].mixer
    cu = jnp.asarray([0, 5, 19, 32], jnp.int32)
    cp, layout = 4, dcp.Zigzag()
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(AxisType.Auto,))
    context = dcp.ContextParallel("cp", layout=layout)
    keep = jnp.asarray(np.r_[0:5, 19:32])
    weights = jr.normal(jr.key(5), (ROW, 32))

    def loss(x):
        y = jax.shard_map(
            lambda x: layer(x, cp=context, cu_seqlens=cu),
            mesh=mesh,
            in_specs=P("cp"),
            out_specs=P("cp"),
        )(layout.to_layout(x, cp, axis=0))
        y = layout.from_layout(y, cp, axis=0)
        return jnp.sum(y[keep] * weights[keep]), y

    run = jax.jit(jax.grad(loss, has_aux=True))
    x = jr.normal(jr.key(4), (ROW, 32))
    clean_grads, clean = run(x)
    grads, y = run(x.at[11].set(jnp.nan))
    assert np.isnan(np.asarray(y[11])).all()
    assert np.isfinite(np.asarray(y[keep])).all() and np.isfinite(np.asarray(grads[keep])).all()
    assert rel_err(y[keep], clean[keep]) <= 1e-6
    assert rel_err(grads[keep], clean_grads[keep]) <= 1e-5


NAN_CASES = [
    pytest.param(
        name,
        layout,
        None,
        id=f"{name}-{layout_id}",
    )
    for name in BUILDERS
    for layout, layout_id in ((dcp.Contiguous(), "contiguous"), (dcp.Zigzag(), "zigzag"))
] + [pytest.param(name, dcp.Contiguous(), "cp", id=f"{name}-experts-split") for name in MOE]


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
@pytest.mark.parametrize("name, layout, experts", NAN_CASES)
def test_nan_stays_in_its_document_at_cp4(name, layout, experts):
    _check_nan_stays_in_its_document(name, 4, layout, experts)


def test_packed_errors():
    model = _model("hybrid")
    tokens = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=[0, 3, 7])
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(tokens, cu_seqlens=[1, 3, 8])
    with pytest.raises(ValueError, match="cu_seqlens"):
        _model("qwen3_5")(tokens, cu_seqlens=[0, 5, 3, 8])


def test_cu_seqlens_not_int(without_runtime_typecheck):
    # What a user without jaxtyping's checks sees.
    tokens = jnp.zeros((8,), jnp.int32)
    with pytest.raises(ValueError, match="`cu_seqlens` must hold ints"):
        _model("hybrid")(tokens, cu_seqlens=[0, 3.5, 8])
    with pytest.raises(ValueError, match="integer array of document offsets"):
        _model("qwen3_5_moe").logits_and_router_stats(tokens, cu_seqlens=jnp.asarray([0.0, 8.0]))


def test_zigzag_row_not_in_two_pieces_per_rank():
    # 6 tokens over 2 zigzag ranks: 3 local tokens do not cut into the 2 pieces each rank
    # holds, and the error says the global length to use (checked while tracing).
    model = _model("hybrid")
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2])
    cp = dcp.ContextParallel("cp", layout=dcp.Zigzag())
    run = jax.shard_map(
        lambda t, cu: model(t, cp=cp, cu_seqlens=cu),
        mesh=mesh,
        in_specs=(P("cp"), P()),
        out_specs=P("cp"),
    )
    tokens = jax.device_put(jnp.zeros((6,), jnp.int32), NamedSharding(mesh, P("cp")))
    cu = jax.device_put(jnp.asarray([0, 2, 6], jnp.int32), NamedSharding(mesh, P()))
    with pytest.raises(ValueError, match=r"must be even; got 3.*multiple of 2 \* cp"):
        jax.jit(run)(tokens, cu)

"""deltanet_cp.data: the packer against per-document references, the hosts' slices against the
layout's order, and the loss under shard_map against one device's and a float64 loop."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.data import (
    add_router_loss,
    causal_lm_loss,
    chunked_causal_lm_loss,
    make_global_batch,
    pack_documents,
    PackedRows,
    process_local_data,
    rank_shard,
    real_tokens,
)
from deltanet_cp.nn import load_balancing_loss, RouterStats


LAYOUTS = [dcp.Contiguous(), dcp.Zigzag()]


def _random_documents(rng, count, longest, vocab=50):
    docs = [rng.integers(1, vocab, rng.integers(1, longest + 1)) for _ in range(count)]
    prompts = [int(rng.integers(0, d.size + 1)) for d in docs]
    return docs, prompts


def _reference_labels(doc, prompt):
    """Position t's target: doc[t + 1] if t + 1 is an answer token, else -100 (a loop)."""
    out = []
    for t in range(len(doc)):
        nxt = t + 1
        out.append(int(doc[nxt]) if nxt < len(doc) and nxt >= prompt else -100)
    return out


def _unpack(packed: PackedRows, num_docs):
    """The documents back from the rows (the pieces of a split one put at their offsets),
    with their labels, and the padding of every row checked."""
    tokens = {i: {} for i in range(num_docs)}
    labels = {i: {} for i in range(num_docs)}
    for row in range(packed.tokens.shape[0]):
        cu, ids = packed.cu_seqlens[row], packed.document_ids[row]
        for k, doc in enumerate(ids):
            lo, hi = int(cu[k]), int(cu[k + 1])
            if doc < 0:  # padding (pad_id, no targets) or an empty segment
                assert packed.document_offsets[row, k] == -1
                assert (packed.tokens[row, lo:hi] == 0).all()
                assert (packed.labels[row, lo:hi] == -100).all()
                continue
            assert hi > lo
            at = int(packed.document_offsets[row, k])
            tokens[int(doc)][at] = packed.tokens[row, lo:hi].tolist()
            labels[int(doc)][at] = packed.labels[row, lo:hi].tolist()

    def joined(pieces):
        return [t for at in sorted(pieces) for t in pieces[at]]

    order = range(num_docs)
    return [joined(tokens[i]) for i in order], [joined(labels[i]) for i in order]


@pytest.mark.parametrize("too_long", ["error", "split"])
def test_packing_round_trips(too_long):
    rng = np.random.default_rng(0)
    row = 16
    docs, prompts = _random_documents(rng, 40, 40 if too_long == "split" else row)
    packed = pack_documents(docs, row, prompt_lengths=prompts, too_long=too_long)
    rows, width = packed.cu_seqlens.shape
    assert packed.tokens.shape == packed.labels.shape == (rows, row)
    assert packed.document_ids.shape == (rows, width - 1)
    for name in PackedRows._fields:
        assert getattr(packed, name).dtype == np.int32, name
    # cu_seqlens: the library's convention, row by row: 0 first, not decreasing, the row's
    # length last; documents first, then at most one padding segment, then empty ones.
    cu = packed.cu_seqlens
    assert (cu[:, 0] == 0).all() and (np.diff(cu, axis=1) >= 0).all() and (cu[:, -1] == row).all()
    for r in range(rows):
        n = int((packed.document_ids[r] >= 0).sum())
        assert (packed.document_ids[r, :n] >= 0).all() and (packed.document_ids[r, n:] == -1).all()
        assert (np.diff(cu[r, : n + 1]) > 0).all()
        assert (cu[r, n + 2 :] == row).all()  # after the padding segment: empty ones
    tokens, labels = _unpack(packed, len(docs))
    for i, (doc, prompt) in enumerate(zip(docs, prompts)):
        assert tokens[i] == doc.tolist(), i
        assert labels[i] == _reference_labels(doc.tolist(), prompt), i
    # First fit, against a plain loop: each piece into the first row with room for it.
    pieces = [(i, min(row, d.size - s)) for i, d in enumerate(docs) for s in range(0, d.size, row)]
    rooms, placed = [], []
    for i, n in pieces:
        r = next((r for r, left in enumerate(rooms) if left >= n), len(rooms))
        if r == len(rooms):
            rooms.append(row)
            placed.append([])
        rooms[r] -= n
        placed[r].append(i)
    assert [[int(i) for i in ids if i >= 0] for ids in packed.document_ids] == placed


def test_loss_masks_and_max_documents():
    docs = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    masks = [np.array([0, 1, 0, 1], bool), np.array([1, 1], bool), np.array([0, 0, 1], bool)]
    packed = pack_documents(docs, 12, loss_masks=masks, max_documents=2, pad_id=0)
    assert packed.cu_seqlens.shape == (2, 4)  # two rows (at most 2 documents each), 2 + 2 wide
    np.testing.assert_array_equal(packed.cu_seqlens, [[0, 4, 6, 12], [0, 3, 12, 12]])
    np.testing.assert_array_equal(packed.document_ids, [[0, 1, -1], [2, -1, -1]])
    np.testing.assert_array_equal(packed.labels[0], [2, -100, 4, -100, 6, -100] + [-100] * 6)
    np.testing.assert_array_equal(packed.labels[1], [-100, 9, -100] + [-100] * 9)
    # A row filled exactly has no padding segment: its unused segments are empty.
    full = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8]], 8)
    np.testing.assert_array_equal(full.cu_seqlens, [[0, 3, 8, 8]])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: pack_documents([[1, 2], []], 8), ValueError, "Document 1 is empty"),
        (lambda: pack_documents([[1, 2]], 1), ValueError, "`row_length` must be at least 2"),
        (lambda: pack_documents([[1, 2.0]], 8), TypeError, "int token ids"),
        (lambda: pack_documents([np.array([1.0, 2.0])], 8), TypeError, "integer array"),
        (lambda: pack_documents([[1, -2]], 8), ValueError, "token id -2"),
        (lambda: pack_documents([[1, 2, 3]], 2), ValueError, 'too_long="split"'),
        (lambda: pack_documents([[1, 2]], 8, prompt_lengths=[3]), ValueError, "more than"),
        (lambda: pack_documents([[1, 2]], 8, prompt_lengths=[]), ValueError, "one entry per"),
        (lambda: pack_documents([], 8), ValueError, "nothing to pack"),
        (
            lambda: pack_documents([[1, 2]], 8, prompt_lengths=[0], loss_masks=[[1, 1]]),
            ValueError,
            "not both",
        ),
        (lambda: pack_documents([[1, 2]], 8, loss_masks=[[1]]), ValueError, "loss_masks"),
    ],
)
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.slow  # three compilations of a layer: ~35 s on two shared CPU cores
def test_vmapped_layer_takes_the_batched_cu_seqlens():
    """The batched form: `jax.vmap` over rows and their padded `cu_seqlens` gives each row
    what the layer gives it with its documents' offsets alone (no empty segments)."""
    packed = pack_documents([[1] * 5, [2] * 7, [3] * 9, [4] * 3], 16, max_documents=3)
    np.testing.assert_array_equal(packed.cu_seqlens, [[0, 5, 12, 15, 16], [0, 9, 16, 16, 16]])
    layer = dcp.nn.GatedDeltaNet(8, 2, 2, 4, 4, chunk_size=4, key=jr.key(0))
    x = jr.normal(jr.key(1), (*packed.tokens.shape, 8))
    out = eqx.filter_jit(lambda m, x, cu: jax.vmap(lambda xi, ci: m(xi, cu_seqlens=ci))(x, cu))(
        layer, x, jnp.asarray(packed.cu_seqlens)
    )
    alone = eqx.filter_jit(lambda m, x, cu: m(x, cu_seqlens=cu))
    for r in range(x.shape[0]):
        cu = np.unique(packed.cu_seqlens[r])  # the same offsets, no empty segment
        np.testing.assert_allclose(out[r], alone(layer, x[r], cu), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # two compilations of a layer under shard_map: ~60 s on two shared cores
@pytest.mark.parametrize("layout", LAYOUTS, ids=["contiguous", "zigzag"])
def test_batched_cu_seqlens_under_context_parallelism(layout):
    """The rows' slices and global offsets (`make_global_batch`) through a layer vmapped
    over rows inside `shard_map` at dp=2 x cp=4: one device's outputs, with documents
    across rank boundaries, a row that is one document, and empty segments."""
    docs = [[1] * 5, [2] * 11, [3] * 19, [4] * 3, [5] * 32, [6] * 2, [7] * 13]
    packed = pack_documents(docs, 32, max_documents=3)
    packed = PackedRows(*(np.resize(a, (4, *a.shape[1:])) for a in packed))
    layer = dcp.nn.GatedDeltaNet(8, 2, 2, 4, 4, chunk_size=2, key=jr.key(0))
    x = np.asarray(jr.normal(jr.key(1), (4, 32, 8)))
    mesh = _mesh()
    batch = make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")
    xs = jax.device_put(layout.to_layout(x, 4), jax.sharding.NamedSharding(mesh, P("dp", "cp")))
    cp = dcp.ContextParallel("cp", layout=layout)
    params, static = eqx.partition(layer, eqx.is_array)

    def per_rank(params, x, cu):
        m = eqx.combine(params, static)
        return jax.vmap(lambda xi, ci: m(xi, cp=cp, cu_seqlens=ci))(x, cu)

    rows, seq = P("dp", None), P("dp", "cp")
    out = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), seq, rows), out_specs=seq))(
        params, xs, batch.cu_seqlens
    )
    one = eqx.filter_jit(lambda m, x, cu: jax.vmap(lambda xi, ci: m(xi, cu_seqlens=ci))(x, cu))(
        layer, x, jnp.asarray(packed.cu_seqlens)
    )
    np.testing.assert_allclose(layout.from_layout(out, 4), one, rtol=1e-5, atol=1e-6)


def _mesh():
    return jax.make_mesh((2, 4), ("dp", "cp"), devices=jax.devices()[:8])


@pytest.mark.parametrize("layout", LAYOUTS, ids=["contiguous", "zigzag"])
def test_hosts_slices_assemble_the_batch_in_layout_order(layout):
    rng = np.random.default_rng(1)
    docs, prompts = _random_documents(rng, 12, 16)
    packed = pack_documents(docs, 16, prompt_lengths=prompts, max_documents=4)
    rows = 4
    packed = PackedRows(*(np.resize(a, (rows, *a.shape[1:])) for a in packed))
    mesh = _mesh()
    batch = make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")
    np.testing.assert_array_equal(batch.tokens, layout.to_layout(packed.tokens, 4))
    np.testing.assert_array_equal(batch.labels, layout.to_layout(packed.labels, 4))
    np.testing.assert_array_equal(batch.cu_seqlens, packed.cu_seqlens)
    np.testing.assert_array_equal(batch.document_ids, packed.document_ids)
    assert batch.tokens.sharding.spec == P("dp", "cp")
    assert batch.cu_seqlens.sharding.spec == P("dp", None)
    # Each device holds its rank's shard: its rows, and in each its pieces of the row (under
    # zigzag pieces r and 2 cp - 1 - r, read here from the sequence directly).
    n = 16 // layout.pieces(4)
    for d, r, c in [(mesh.devices[i, j], i, j) for i in range(2) for j in range(4)]:
        shard = rank_shard(packed, layout, cp=4, context_rank=c, dp=2, data_rank=r)
        pieces = [c] if n == 4 else [c, 7 - c]
        mine = packed.tokens[2 * r : 2 * r + 2]
        expect = np.concatenate([mine[:, p * n : (p + 1) * n] for p in pieces], 1)
        np.testing.assert_array_equal(shard.tokens, expect)
        held = {s.device: np.asarray(s.data) for s in batch.tokens.addressable_shards}
        np.testing.assert_array_equal(held[d], expect)
        held_cu = {s.device: np.asarray(s.data) for s in batch.cu_seqlens.addressable_shards}
        np.testing.assert_array_equal(held_cu[d], packed.cu_seqlens[2 * r : 2 * r + 2])
    # What a host holding data rank 1 and context ranks 2, 3 hands
    # `make_array_from_process_local_data`: its rows, its ranks' shards side by side.
    host = process_local_data(
        packed, mesh, layout, data_axis="dp", context_axis="cp", devices=mesh.devices[1, 2:]
    )
    shards = [rank_shard(packed, layout, cp=4, context_rank=c, dp=2, data_rank=1) for c in (2, 3)]
    np.testing.assert_array_equal(host.tokens, np.concatenate([s.tokens for s in shards], 1))
    np.testing.assert_array_equal(host.labels, np.concatenate([s.labels for s in shards], 1))
    np.testing.assert_array_equal(host.cu_seqlens, packed.cu_seqlens[2:])
    # Devices that are no block of the batch are refused.
    with pytest.raises(ValueError, match="rectangular block"):
        process_local_data(
            packed,
            mesh,
            layout,
            data_axis="dp",
            context_axis="cp",
            devices=[mesh.devices[0, 0], mesh.devices[1, 1]],
        )


@pytest.mark.parametrize("layout", LAYOUTS, ids=["contiguous", "zigzag"])
def test_real_tokens_on_each_rank(layout):
    # Rows of 16: the padding (and only it) is not real, prompts are; each rank's mask,
    # taken inside shard_map from its block of the global batch, is its shard of the rows'.
    docs = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 9], [3] * 11, [7] * 13]
    packed = pack_documents(docs, 16, prompt_lengths=[1, 2, 0, 3, 0], max_documents=3)
    np.testing.assert_array_equal(
        packed.cu_seqlens, [[0, 3, 8, 10, 16], [0, 11, 16, 16, 16], [0, 13, 16, 16, 16]]
    )
    packed = PackedRows(*(np.resize(a, (4, *a.shape[1:])) for a in packed))  # 2 per data rank
    want = np.zeros((4, 16), bool)
    for r, n in enumerate([10, 11, 13, 10]):
        want[r, :n] = True
    np.testing.assert_array_equal(real_tokens(packed), want)
    mesh = _mesh()
    batch = make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")
    cp = dcp.ContextParallel("cp", layout=layout)
    tok, row = P("dp", "cp"), P("dp", None)
    per_rank = jax.jit(
        jax.shard_map(
            lambda b: real_tokens(b, cp=cp),
            mesh=mesh,
            in_specs=(PackedRows(tok, tok, row, row, row),),
            out_specs=tok,
        )
    )
    np.testing.assert_array_equal(per_rank(batch), layout.to_layout(want, 4))
    # A rank's shard is not whole rows: without `cp` it is refused.
    shard = rank_shard(packed, layout, cp=4, context_rank=1)
    with pytest.raises(ValueError, match="not whole rows"):
        real_tokens(shard)


def test_slicing_bad_input():
    packed = pack_documents([[1, 2, 3]], 6)
    with pytest.raises(ValueError, match="multiple of the context-parallel size 4"):
        rank_shard(packed, dcp.Contiguous(), cp=4, context_rank=0)
    with pytest.raises(ValueError, match="4 pieces Zigzag.*`row_length` that is a multiple of 4"):
        rank_shard(packed, dcp.Zigzag(), cp=2, context_rank=0)
    with pytest.raises(ValueError, match="`row_length` that is a multiple of 4"):
        make_global_batch(packed, _mesh(), dcp.Zigzag(), data_axis=None, context_axis="dp")
    # Fields that do not fit together: labels of another shape, offsets of other rows.
    short = packed._replace(labels=packed.labels[:, :5])
    with pytest.raises(ValueError, match=r"`packed.labels` must have the shape .* \(1, 6\)"):
        rank_shard(short, dcp.Contiguous(), cp=2, context_rank=0)
    with pytest.raises(ValueError, match=r"`packed.labels` must have the shape"):
        make_global_batch(short, _mesh(), dcp.Contiguous(), data_axis=None, context_axis="dp")
    with pytest.raises(ValueError, match=r"`packed.cu_seqlens` must be \(rows, segments \+ 1\)"):
        rank_shard(
            packed._replace(cu_seqlens=packed.cu_seqlens[0]), dcp.Contiguous(), cp=2, context_rank=0
        )
    with pytest.raises(ValueError, match=r"`packed.document_ids` must be \(rows, segments\)"):
        rank_shard(
            packed._replace(document_ids=packed.document_ids[:, :1]),
            dcp.Contiguous(),
            cp=2,
            context_rank=0,
        )
    with pytest.raises(ValueError, match="no axis 'x'"):
        make_global_batch(packed, _mesh(), dcp.Contiguous(), data_axis="x", context_axis="cp")


def _reference_loss(logits, labels):
    """Mean cross entropy over the real targets, float64, token by token."""
    total, count = 0.0, 0
    z = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    for zt, lt in zip(z, np.asarray(labels).reshape(-1)):
        if lt != -100:
            total += np.log(np.exp(zt - zt.max()).sum()) + zt.max() - zt[lt]
            count += 1
    return total / count, count


@pytest.mark.parametrize("layout", LAYOUTS, ids=["contiguous", "zigzag"])
def test_loss_over_ranks_is_the_batch_mean(layout):
    rng = np.random.default_rng(2)
    docs, prompts = _random_documents(rng, 10, 16, vocab=11)
    packed = pack_documents(docs, 16, prompt_lengths=prompts, max_documents=4)
    packed = PackedRows(*(np.resize(a, (4, *a.shape[1:])) for a in packed))
    labels = packed.labels.copy()
    labels[0, :12] = -100  # uneven: rows of data rank 0 keep few targets, in a few ranks
    labels[1, 4:] = -100
    packed = packed._replace(labels=labels)
    logits = rng.normal(size=(4, 16, 11)).astype(np.float32) * 3
    mesh = _mesh()
    batch = make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")
    sharding = jax.sharding.NamedSharding(mesh, P("dp", "cp"))
    z = jax.device_put(layout.to_layout(logits, 4), sharding)

    def per_rank(z, labels):
        loss, count = causal_lm_loss(z, labels, axis_name=("dp", "cp"))
        own, own_count = causal_lm_loss(z, labels)  # this rank's own mean
        return loss, count, own[None, None], own_count[None, None]

    spec = P("dp", "cp")
    sharded = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(spec, spec), out_specs=(P(), P(), spec, spec))
    )
    loss, count, own, own_count = sharded(z, batch.labels)
    one_loss, one_count = jax.jit(causal_lm_loss)(jnp.asarray(logits), jnp.asarray(labels))
    ref, ref_count = _reference_loss(logits, labels)
    assert int(count) == int(one_count) == ref_count
    np.testing.assert_allclose(loss, one_loss, rtol=1e-6)
    np.testing.assert_allclose(one_loss, ref, rtol=1e-6)
    # The counts are uneven over ranks, and a mean of the ranks' means would be wrong.
    own, own_count = np.asarray(own), np.asarray(own_count)
    assert len(set(own_count.ravel().tolist())) > 2
    assert abs(own[own_count > 0].mean() - ref) > 1e-2 * ref
    # A label outside the vocabulary on one rank is an error (raised on every rank).
    bad = np.asarray(batch.labels).copy()
    bad[3, 5] = 11
    with pytest.raises(Exception, match=r"must lie in \[0, 11\)"):
        jax.block_until_ready(sharded(z, jax.device_put(bad, batch.labels.sharding)))


def test_loss_checks_its_labels_and_casts_to_float32():
    logits = jnp.zeros((3, 5), jnp.bfloat16)
    loss, count = causal_lm_loss(logits, jnp.asarray([1, -100, 4]))
    assert loss.dtype == jnp.float32 and int(count) == 2
    np.testing.assert_allclose(loss, np.log(5), rtol=1e-6)
    loss, count = causal_lm_loss(logits, jnp.full((3,), -100))
    assert float(loss) == 0.0 and int(count) == 0
    with pytest.raises(ValueError, match="shape of `logits`"):
        causal_lm_loss(logits, jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="integer array"):
        causal_lm_loss(logits, jnp.zeros((3,), jnp.float32))
    with pytest.raises(Exception, match=r"must lie in \[0, 5\)"):
        jax.jit(causal_lm_loss)(logits, jnp.asarray([1, 5, 0]))


def _head_problem(dtype):
    """Hidden states `(2, 12, 8)`, a head `(11, 8)` and labels with ignored positions."""
    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(2, 12, 8))
    weight = rng.normal(size=(11, 8))
    labels = rng.integers(0, 11, (2, 12))
    labels[0, 3] = labels[1, :5] = -100
    return jnp.asarray(hidden, dtype), jnp.asarray(weight, dtype), jnp.asarray(labels, jnp.int32)


@pytest.mark.parametrize(
    "dtype, rtol, chunks", [("float64", 1e-6, (1, 4)), ("float32", 1e-5, (12,))]
)
def test_chunked_loss_is_the_full_logits_loss(dtype, rtol, chunks):
    # The loss against a float64 loop over the tokens, and the loss and its gradients
    # against causal_lm_loss of the full logits, at chunks of 1, 4 and 12 (all) positions.
    with jax.enable_x64(dtype == "float64"):
        hidden, weight, labels = _head_problem(jnp.dtype(dtype))
        ref, ref_count = _reference_loss(np.asarray(hidden) @ np.asarray(weight).T, labels)

        def full(h, w):
            return causal_lm_loss(h @ w.T, labels)[0]

        value, grads = jax.jit(jax.value_and_grad(full, (0, 1)))(hidden, weight)
        for chunk in chunks:

            def chunked(h, w):
                return chunked_causal_lm_loss(h, w, labels, chunk_size=chunk)

            (loss, count), got = jax.jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(
                hidden, weight
            )
            assert loss.dtype == jnp.float32 and int(count) == ref_count
            np.testing.assert_allclose(loss, ref, rtol=1e-6)
            np.testing.assert_allclose(loss, value, rtol=1e-6)
            for g, want in zip(got, grads):
                assert g.dtype == want.dtype
                np.testing.assert_allclose(g, want, rtol=rtol, atol=rtol * np.abs(want).max())


def test_chunked_loss_over_ranks_is_one_devices():
    # Rows over "dp", positions over "cp": the psum'd mean and the gradients are one
    # device's.
    hidden, weight, labels = _head_problem(jnp.float32)
    hidden = jnp.concatenate([hidden, hidden[:, ::-1]])  # four rows, 3 positions a rank
    labels = jnp.concatenate([labels, labels[:, ::-1]])
    mesh = _mesh()
    split = jax.sharding.NamedSharding(mesh, P("dp", "cp"))
    placed = jax.device_put(hidden, split), jax.device_put(labels, split)

    def per_rank(h, w, y):
        return chunked_causal_lm_loss(h, w, y, chunk_size=3, axis_name=("dp", "cp"))[0]

    sharded = jax.shard_map(
        per_rank, mesh=mesh, in_specs=(P("dp", "cp"), P(), P("dp", "cp")), out_specs=P()
    )
    value, grads = jax.jit(jax.value_and_grad(sharded, (0, 1)))(placed[0], weight, placed[1])
    one, one_grads = jax.jit(
        jax.value_and_grad(lambda h, w: causal_lm_loss(h @ w.T, labels)[0], (0, 1))
    )(hidden, weight)
    np.testing.assert_allclose(value, one, rtol=1e-6)
    for g, want in zip(grads, one_grads):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_chunked_loss_names_bad_arguments(without_runtime_typecheck):
    hidden, weight, labels = _head_problem(jnp.float32)
    for bad in (0, 5, -4, 2.0, True):
        with pytest.raises(ValueError, match="`chunk_size` must be a positive integer dividing"):
            chunked_causal_lm_loss(hidden, weight, labels, chunk_size=bad)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="`weight` must be the LM head's"):
        chunked_causal_lm_loss(hidden, weight.T, labels, chunk_size=4)
    with pytest.raises(ValueError, match="shape of `hidden`"):
        chunked_causal_lm_loss(hidden, weight, labels[:, :4], chunk_size=4)
    with pytest.raises(ValueError, match="integer array"):
        chunked_causal_lm_loss(hidden, weight, labels.astype(jnp.float32), chunk_size=4)
    with pytest.raises(Exception, match=r"must lie in \[0, 11\)"):
        jax.jit(lambda y: chunked_causal_lm_loss(hidden, weight, y, chunk_size=4))(
            labels.at[1, 7].set(11)
        )
    # Bfloat16 operands: the logits' products kept in float32 (the exact products' loss).
    h16, w16 = hidden.astype(jnp.bfloat16), weight.astype(jnp.bfloat16)
    (loss, _), grads = jax.jit(
        jax.value_and_grad(
            lambda w: chunked_causal_lm_loss(h16, w, labels, chunk_size=4), has_aux=True
        )
    )(w16)
    exact, _ = _reference_loss(
        np.asarray(h16, np.float64) @ np.asarray(w16, np.float64).T, np.asarray(labels)
    )
    np.testing.assert_allclose(loss, exact, rtol=1e-6)
    assert grads.dtype == jnp.bfloat16


def test_router_loss_sums_rows_before_normalising():
    rng = np.random.default_rng(3)
    counts = rng.integers(0, 5, (3, 4)).astype(np.float32)
    probs = rng.random((3, 4)).astype(np.float32)
    tokens = np.asarray([5.0, 7.0, 2.0], np.float32)
    stats = jax.vmap(RouterStats)(jnp.asarray(counts), jnp.asarray(probs), jnp.asarray(tokens))
    out = add_router_loss(jnp.asarray(1.5), stats, 0.01)
    n = tokens.sum()
    expect = 1.5 + 0.01 * 4 * np.sum((counts.sum(0) / n) * (probs.sum(0) / n))
    np.testing.assert_allclose(out, expect, rtol=1e-6)
    summed = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
    np.testing.assert_allclose(out, 1.5 + 0.01 * load_balancing_loss(summed), rtol=1e-6)


def test_router_loss_of_stats_not_varying_over_every_axis():
    # Stats that vary over "dp" only (e.g. the token count of a mask made from per-row
    # fields, or a context axis of size 1), summed over ("dp", "cp"): each rank's is its own
    # part, and the normalised loss is the rows' (it was a tracing error).
    rng = np.random.default_rng(4)
    counts = rng.integers(0, 5, (2, 4)).astype(np.float32)
    probs = rng.random((2, 4)).astype(np.float32)
    tokens = np.asarray([5.0, 7.0], np.float32)
    stats = jax.vmap(RouterStats)(jnp.asarray(counts), jnp.asarray(probs), jnp.asarray(tokens))
    one = add_router_loss(jnp.zeros(()), stats, 1.0)
    mesh = _mesh()
    stats = jax.device_put(stats, jax.sharding.NamedSharding(mesh, P("dp")))
    per_rank = jax.shard_map(
        lambda s: add_router_loss(jnp.zeros(()), s, 1.0, axis_name=("dp", "cp")),
        mesh=mesh,
        in_specs=(P("dp"),),
        out_specs=P(),
    )
    np.testing.assert_allclose(jax.jit(per_rank)(stats), one, rtol=1e-6)

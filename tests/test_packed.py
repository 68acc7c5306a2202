"""Packed documents (`cu_seqlens`): per-document parity with the float64 loops, on one
device and with documents crossing rank boundaries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp

from .helpers import gated_delta_reference, rel_err
from .test_kda import kda_reference


T, HV, DK, DV = 64, 2, 8, 4


def _inputs(seed, per_key):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(1, T, 1, DK))
    k = 0.7 * rng.normal(size=(1, T, 1, DK)) / np.sqrt(DK)
    v = rng.normal(size=(1, T, HV, DV))
    g = -np.exp(rng.uniform(-5.0, 0.0, size=(1, T, HV) + ((DK,) if per_key else ())))
    beta = rng.uniform(size=(1, T, HV))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]


def _gdn(q, k, v, g, beta, h0, cu, **kw):
    return dcp.chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm=True,
        cu_seqlens=cu,
        **kw,
    )


def _gdn_cp(q, k, v, g, beta, h0, cu, **kw):
    return dcp.chunk_gated_delta_rule_cp(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm=True,
        cu_seqlens=cu,
        **kw,
    )


def _kda(q, k, v, g, beta, h0, cu, chunk_size, **kw):
    return dcp.chunk_kimi_delta_attention(
        q, k, v, g, beta, chunk_size, h0, True, True, cu_seqlens=cu, **kw
    )


def _kda_cp(q, k, v, g, beta, h0, cu, chunk_size, **kw):
    return dcp.chunk_kimi_delta_attention_cp(
        q, k, v, g, beta, chunk_size, h0, True, True, cu_seqlens=cu, **kw
    )


KINDS = {
    "gdn": (_gdn, _gdn_cp, gated_delta_reference, False),
    "kda": (_kda, _kda_cp, kda_reference, True),
}


def _per_document(reference, args, cu, h0):
    q, k, v, g, beta = args
    outs, finals = [], []
    for n in range(len(cu) - 1):
        a, b = int(cu[n]), int(cu[n + 1])
        o, h = reference(
            *(x[:, a:b] for x in (q, k, v, g, beta)),
            initial_state=None if h0 is None else h0[n : n + 1],
            l2norm=True,
        )
        outs.append(o)
        finals.append(h[0])
    return np.concatenate(outs, axis=1), np.stack(finals)


CU = [
    [0, 5, 5, 40, 41, 64],  # an empty document, one-token documents
    [0, 17, 30, 64, 64],  # an empty document at the end
]


@pytest.mark.parametrize("kind", ["gdn", "kda"])
@pytest.mark.parametrize("cu", CU)
def test_single_device(kind, cu):
    fn, _, reference, per_key = KINDS[kind]
    args = _inputs(0, per_key)
    n = len(cu) - 1
    h0 = jnp.asarray(np.random.default_rng(1).normal(size=(n, HV, DK, DV)), jnp.float32)
    o, finals = jax.jit(lambda cu, h0, *a: fn(*a, h0, cu, chunk_size=8))(
        jnp.asarray(cu, jnp.int32), h0, *args
    )
    expected_o, expected_h = _per_document(reference, args, np.asarray(cu), h0)
    assert o.shape == args[2].shape and finals.shape == (n, HV, DK, DV)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5


@pytest.mark.parametrize(
    "kind, strategy", [("gdn", "allgather"), ("gdn", "ring"), ("kda", "ppermute")]
)
def test_context_parallel_documents_cross_ranks(kind, strategy):
    _, fn, reference, per_key = KINDS[kind]
    cp = 4
    cu = jnp.asarray([0, 5, 5, 40, 41, 64], jnp.int32)  # 40 and 41 cross rank 2's slice
    n = cu.shape[0] - 1
    args = _inputs(2, per_key)
    h0 = jnp.asarray(np.random.default_rng(3).normal(size=(n, HV, DK, DV)), jnp.float32)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])

    def per_rank(cu, h0, *a):
        return fn(*a, h0, cu, chunk_size=4, axis_name="cp", strategy=strategy)

    seq = P(None, "cp")
    sharded = jax.jit(
        jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), P()) + (seq,) * 5, out_specs=(seq, P()))
    )
    rep = NamedSharding(mesh, P())
    o, finals = sharded(
        jax.device_put(cu, rep),
        jax.device_put(h0, rep),
        *(jax.device_put(x, NamedSharding(mesh, seq)) for x in args),
    )
    expected_o, expected_h = _per_document(reference, args, np.asarray(cu), h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, expected_h) <= 1e-5


def test_bad_cu_seqlens(without_runtime_typecheck):
    args = _inputs(0, True)
    with pytest.raises(ValueError, match="must end at the"):
        _kda(*args, None, jnp.asarray([0, 10, 60], jnp.int32), 8)
    with pytest.raises(ValueError, match="not decrease"):
        _kda(*args, None, jnp.asarray([0, 30, 20, 64], jnp.int32), 8)
    with pytest.raises(ValueError, match="integer array"):
        _kda(*args, None, jnp.asarray([0.0, 64.0]), 8)
    with pytest.raises(ValueError, match="batch of one"):
        _kda(*(jnp.concatenate([x, x]) for x in args), None, jnp.asarray([0, 64], jnp.int32), 8)
    with pytest.raises(ValueError, match="one per document"):
        _kda(*args, jnp.zeros((3, HV, DK, DV)), jnp.asarray([0, 64], jnp.int32), 8)

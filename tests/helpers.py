"""Test helpers: the independent float64 references, input generators and comparisons.

Nothing here imports from `deltanet_cp`: the loops below are the ground truth the library
is checked against. Each runs one token at a time in float64 numpy, exactly as the
recurrence is written on paper. `tests/registry.py` pairs them with the library's functions.

Layouts (the library's): q, k `(B, T, H, K)`; v `(B, T, HV, V)`; value head `j` reads key
head `j // (HV // H)`; states `(B, HV, K, V)`; outputs `(B, T, HV, V)`. With `cu_seqlens`
(documents packed along the time axis of a batch of one) every loop runs once per
document from that document's initial state, and returns the per-document final states
`(N, HV, K, V)`.
"""

import functools as ft
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import deltanet_cp as dcp


Reference = Callable[..., tuple[np.ndarray, np.ndarray]]


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


def assert_split_as_specs(specs: Any, sizes: Any, *trees: Any) -> None:
    """Every array of each of `trees` (placed on a mesh of axis `sizes`, its `shape`
    mapping) is split as its `PartitionSpec` in `specs` (of the trees' structure) says:
    each of its shards has the whole shape divided by the sizes of the axes of its
    dimension's entry."""
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    for tree in trees:
        for x, spec in zip(jax.tree.leaves(tree), spec_leaves, strict=True):
            entries = (*spec, *(None,) * (x.ndim - len(spec)))
            want = tuple(
                d // (1 if e is None else int(np.prod([sizes[a] for a in np.atleast_1d(e)])))
                for d, e in zip(x.shape, entries)
            )
            shapes = {shard.data.shape for shard in x.addressable_shards}
            assert shapes == {want}, (spec, x.shape, shapes)


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (a scale-aware relative error)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {a.shape} vs {e.shape}")
    if a.size == 0:
        return 0.0
    denom = max(np.max(np.abs(e)), 1e-30)
    return float(np.max(np.abs(a - e)) / denom)


# ---------------------------------------------------------------------------------------
# The float64 loops
# ---------------------------------------------------------------------------------------


def _f64(*xs) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.float64) for x in xs]


def _l2norm(x):
    return x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6)


def _start(initial_state, shape):
    return np.zeros(shape) if initial_state is None else np.array(initial_state, np.float64)


def _per_document(loop: Reference) -> Reference:
    """Add `cu_seqlens` to a loop: run it on each document's tokens (time axis 1 of every
    argument), from `initial_state[n]` for document `n` (zeros if `None`)."""

    @ft.wraps(loop)
    def wrapper(*args, initial_state=None, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return loop(*args, initial_state=initial_state, **kwargs)
        cu = [int(c) for c in np.asarray(cu_seqlens)]
        assert cu[0] == 0 and all(a <= b for a, b in itertools.pairwise(cu))
        assert all(x is None or x.shape[0] == 1 for x in args), "packing needs batch 1"
        outs, finals = [], []
        for n, (a, b) in enumerate(itertools.pairwise(cu)):
            h0 = None if initial_state is None else np.asarray(initial_state)[n : n + 1]
            doc = [None if x is None else np.asarray(x)[:, a:b] for x in args]
            o, h = loop(*doc, initial_state=h0, **kwargs)
            outs.append(o)
            finals.append(h[0])
        return np.concatenate(outs, axis=1), np.stack(finals)

    return wrapper


@_per_document
def gated_delta_reference(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False):
    """The gated delta rule: per token, `S = exp(g) S`, `S += k (beta (v - k^T S))^T`,
    `o = (scale q)^T S`. g, beta: `(B, T, HV)`."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kh = np.repeat(k, hv // h, axis=2)  # value head j reads key head j // r
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):  # one token at a time, all batch elements and heads at once
        kt = kh[:, ti]  # (b, hv, dk)
        state = np.exp(g[:, ti])[..., None, None] * state
        predicted = np.einsum("bhkv,bhk->bhv", state, kt)
        delta = beta[:, ti][..., None] * (v[:, ti] - predicted)
        state = state + np.einsum("bhk,bhv->bhkv", kt, delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def delta_reference(q, k, v, beta, *, scale=None, initial_state=None, l2norm=False):
    """The delta rule (no decay): per token, `S += k (beta (v - k^T S))^T`, `o = (scale q)^T S`."""
    q, k, v, beta = _f64(q, k, v, beta)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kh = np.repeat(k, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        delta = beta[:, ti][..., None] * (v[:, ti] - np.einsum("bhkv,bhk->bhv", state, kh[:, ti]))
        state = state + np.einsum("bhk,bhv->bhkv", kh[:, ti], delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False):
    """Kimi Delta Attention: the gated delta rule with a log decay per key channel,
    g `(B, T, HV, K)`: row `i` of `S` is scaled by `exp(g[i])`."""
    q, k, v, g, beta = _f64(q, k, v, g, beta)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kh = np.repeat(k, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        state = np.exp(g[:, ti])[..., :, None] * state
        delta = beta[:, ti][..., None] * (v[:, ti] - np.einsum("bhkv,bhk->bhv", state, kh[:, ti]))
        state = state + np.einsum("bhk,bhv->bhkv", kh[:, ti], delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def gla_reference(q, k, v, g, *, scale=None, initial_state=None, l2norm=False):
    """Gated linear attention: per token, `S = diag(exp(g)) S + k v^T`, `o = (scale q)^T S`;
    g is `(B, T, HV)` (one decay per head) or `(B, T, HV, K)` (per key channel)."""
    q, k, v, g = _f64(q, k, v, g)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    if g.ndim == 3:
        g = np.repeat(g[..., None], dk, axis=-1)  # one decay per head: every channel
    kh = np.repeat(k, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        state = np.exp(g[:, ti])[..., :, None] * state
        state = state + np.einsum("bhk,bhv->bhkv", kh[:, ti], v[:, ti])
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def delta_product_reference(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False):
    """Gated DeltaProduct: per token, decay once (`g` `(B, T, HV)` or `None`), then `n_h`
    delta steps with k `(B, T, n_h, H, K)`, v `(B, T, n_h, HV, V)`, beta `(B, T, n_h, HV)`,
    then the output after the last step."""
    q, k, v, beta = _f64(q, k, v, beta)
    b, t, n, h, dk = k.shape
    hv, dv = v.shape[3], v.shape[4]
    g = np.zeros((b, t, hv)) if g is None else np.asarray(g, dtype=np.float64)
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kh = np.repeat(k, hv // h, axis=3)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (b, hv, dk, dv))
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        state = np.exp(g[:, ti])[..., None, None] * state
        for j in range(n):
            kt = kh[:, ti, j]
            predicted = np.einsum("bhkv,bhk->bhv", state, kt)
            delta = beta[:, ti, j][..., None] * (v[:, ti, j] - predicted)
            state = state + np.einsum("bhk,bhv->bhkv", kt, delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def gdn2_reference(q, k, v, g, b, w, *, scale=None, initial_state=None, l2norm=False):
    """Gated DeltaNet-2: per token, `S = diag(exp(g)) S`, then `S += k (w * v - S^T (b * k))^T`,
    `o = (scale q)^T S`; g and the erase gate b `(B, T, HV, K)`, the write gate w
    `(B, T, HV, V)`."""
    q, k, v, g, b, w = _f64(q, k, v, g, b, w)
    bs, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    kh = np.repeat(k, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (bs, hv, dk, dv))
    o = np.zeros((bs, t, hv, dv))
    for ti in range(t):
        kt = kh[:, ti]
        state = np.exp(g[:, ti])[..., :, None] * state
        erased = np.einsum("bhkv,bhk->bhv", state, b[:, ti] * kt)
        state = state + np.einsum("bhk,bhv->bhkv", kt, w[:, ti] * v[:, ti] - erased)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


@_per_document
def dplr_reference(q, k, v, a, b, gk, *, scale=None, initial_state=None, l2norm=False):
    """The generalized (diagonal plus low rank) delta rule: per token,
    `S = diag(exp(gk)) S + b (a^T S) + k v^T` (`a^T S` read from the state before the
    token), `o = (scale q)^T S`; q, k, a, b `(B, T, H, K)`, gk `(B, T, HV, K)`."""
    assert not l2norm
    q, k, v, a, b, gk = _f64(q, k, v, a, b, gk)
    bs, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    kh, ah, bh = (np.repeat(x, hv // h, axis=2) for x in (k, a, b))
    qh = np.repeat(q, hv // h, axis=2) * scale
    state = _start(initial_state, (bs, hv, dk, dv))
    o = np.zeros((bs, t, hv, dv))
    for ti in range(t):
        read = np.einsum("bhkv,bhk->bhv", state, ah[:, ti])
        state = (
            np.exp(gk[:, ti])[..., :, None] * state
            + np.einsum("bhk,bhv->bhkv", bh[:, ti], read)
            + np.einsum("bhk,bhv->bhkv", kh[:, ti], v[:, ti])
        )
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


# -- The preconditioned delta rules (flash-linear-attention's precond_gated_delta_rule and
# precond_kda): a diagonal preconditioner per key head, then a delta rule writing along the
# preconditioned key.


def _precond_loop(
    q,
    k,
    v,
    g_atk,
    g,
    beta_atk,
    beta,
    *,
    scale,
    initial_state,
    initial_A_state,
    l2norm,
    x,
    eps,
    log_atk_scale,
):
    q, k, v, g_atk, g, beta_atk, beta = _f64(q, k, v, g_atk, g, beta_atk, beta)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // h
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    center = np.asarray(log_atk_scale, np.float64)
    center = center[None, :, None] if center.ndim == 1 else center  # one per key head
    state = _start(initial_state, (b, hv, dk, dv))
    precond = _start(initial_A_state, (b, h, dk))  # one diagonal state per key head
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        kt = k[:, ti]  # (b, h, dk)
        precond = np.exp(g_atk[:, ti])[..., None] * precond + beta_atk[:, ti][..., None] * kt**2
        c = np.log(precond + eps) - center
        write = kt * x ** (-c / (1.0 + np.abs(c)))  # a scale in (1/x, x) per channel
        erase_h, write_h = np.repeat(kt, r, axis=1), np.repeat(write, r, axis=1)
        decay = np.exp(g[:, ti])  # (b, hv) or (b, hv, dk)
        state = (decay[..., None, None] if decay.ndim == 2 else decay[..., None]) * state
        delta = beta[:, ti][..., None] * (v[:, ti] - np.einsum("bhkv,bhk->bhv", state, erase_h))
        state = state + np.einsum("bhk,bhv->bhkv", write_h, delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, np.repeat(q[:, ti], r, axis=1) * scale)
    return o, state, precond


def precond_reference(
    q,
    k,
    v,
    g_atk,
    g,
    beta_atk,
    beta,
    *,
    scale=None,
    initial_state=None,
    initial_A_state=None,
    l2norm=False,
    cu_seqlens=None,
    x=1.5,
    eps=1e-6,
    log_atk_scale: float | np.ndarray = -0.2,
):
    """The preconditioned delta rule, per token: per key head the diagonal state
    `A = exp(g_atk) A + beta_atk k^2`, `c = log(A + eps) - log_atk_scale`, the write key
    `k^ = k x^(-c / (1 + |c|))`; then per value head `S = exp(g) S` (g `(B, T, HV)`, or per
    key channel `(B, T, HV, K)`: KDA), `S += k^ (beta (v - k^T S))^T`, `o = (scale q)^T S`.
    `log_atk_scale` a float or one per key head `(H,)`. Returns `(o, S, A)`: A `(B, H, K)`
    (with `cu_seqlens`, both final states per document)."""
    kw = dict(scale=scale, l2norm=l2norm, x=x, eps=eps, log_atk_scale=log_atk_scale)
    args = (q, k, v, g_atk, g, beta_atk, beta)
    if cu_seqlens is None:
        return _precond_loop(
            *args, initial_state=initial_state, initial_A_state=initial_A_state, **kw
        )
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    outs, finals, a_finals = [], [], []
    for n, (a, b) in enumerate(itertools.pairwise(cu)):
        h0 = None if initial_state is None else np.asarray(initial_state)[n : n + 1]
        a0 = None if initial_A_state is None else np.asarray(initial_A_state)[n : n + 1]
        doc = [np.asarray(x)[:, a:b] for x in args]
        o, s, p = _precond_loop(*doc, initial_state=h0, initial_A_state=a0, **kw)
        outs.append(o)
        finals.append(s[0])
        a_finals.append(p[0])
    return np.concatenate(outs, axis=1), np.stack(finals), np.stack(a_finals)


def precond_gated_delta_reference(q, k, v, g_atk, g, beta_atk, beta, **kwargs):
    """`precond_reference` in the argument order of `chunk_precond_gated_delta_rule`, `(o, S)`."""
    return precond_reference(q, k, v, g_atk, g, beta_atk, beta, **kwargs)[:2]


def precond_kda_reference(q, k, v, g, g_atk, beta_atk, beta, **kwargs):
    """`precond_reference` in the argument order of `chunk_precond_kda` (g per key channel),
    `(o, S)`."""
    return precond_reference(q, k, v, g_atk, g, beta_atk, beta, **kwargs)[:2]


# ---------------------------------------------------------------------------------------
# Input generators: numpy-generated (no compilation), returned as jax arrays of `dtype`;
# `(args in the public argument order, initial state (B, HV, K, V) float32)`.
# ---------------------------------------------------------------------------------------


@_per_document
def _momentum_loop(
    q, k, v, log_alpha, log_mu, p, beta, eta, *, scale, initial_state, l2norm, p_times_alpha
):
    q, k, v, la, lm, p, beta, eta = _f64(q, k, v, log_alpha, log_mu, p, beta, eta)
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q, k, p = _l2norm(q), _l2norm(k), _l2norm(p)
    kh, ph = np.repeat(k, hv // h, axis=2), np.repeat(p, hv // h, axis=2)
    qh = np.repeat(q, hv // h, axis=2) * scale
    joint = _start(initial_state, (b, hv, 2 * dk, dv))
    memory, momentum = joint[:, :, :dk], joint[:, :, dk:]
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):
        alpha, mu = np.exp(la[:, ti])[..., None, None], np.exp(lm[:, ti])[..., None, None]
        probe = ph[:, ti] * (np.exp(la[:, ti])[..., None] if p_times_alpha else 1.0)
        residual = np.einsum("bhkv,bhk->bhv", memory, probe) - v[:, ti]
        write = eta[:, ti][..., None] * kh[:, ti]
        momentum = mu * momentum + np.einsum("bhk,bhv->bhkv", write, residual)
        memory = alpha * memory - beta[:, ti][..., None, None] * momentum
        o[:, ti] = np.einsum("bhkv,bhk->bhv", memory, qh[:, ti])
    return o, np.concatenate([memory, momentum], axis=2)


def momentum_reference(
    q,
    k,
    v,
    log_alpha,
    log_mu,
    p=None,
    beta=None,
    eta=None,
    *,
    scale=None,
    initial_state=None,
    l2norm=False,
    cu_seqlens=None,
    p_times_alpha=True,
):
    """The momentum delta rule, with the memory `S` and the momentum `M` of each value head
    as one state of `2K` rows `[S; M]`, `(B, HV, 2K, V)`: per token, with `p~ = exp(log_alpha)
    p` (`p_times_alpha`) or `p`, `M = exp(log_mu) M + (eta k) (S^T p~ - v)^T`,
    `S = exp(log_alpha) S - beta M`, `o = (scale q)^T S`. log_alpha, log_mu, beta, eta:
    `(B, T, HV)`; `p` defaults to `k`, `beta` and `eta` to ones."""
    ones = np.ones(np.shape(v)[:3])
    return _momentum_loop(
        q,
        k,
        v,
        log_alpha,
        log_mu,
        k if p is None else p,
        ones if beta is None else beta,
        ones if eta is None else eta,
        scale=scale,
        initial_state=initial_state,
        l2norm=l2norm,
        cu_seqlens=cu_seqlens,
        p_times_alpha=p_times_alpha,
    )


def split_momentum_state(h):
    """`(..., 2K, V)` rows `[S; M]` -> flash-linear-attention's stacked `(2, ..., K, V)`."""
    dk = h.shape[-2] // 2
    return np.stack([np.asarray(h)[..., :dk, :], np.asarray(h)[..., dk:, :]])


def _cast(dtype, *xs) -> tuple[Any, ...]:
    return tuple(jnp.asarray(x, dtype) for x in xs)


def _state(rng, b, hv, dk, dv):
    return jnp.asarray(rng.normal(size=(b, hv, dk, dv)), jnp.float32)


def make_gated_delta_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)  # |k| < 1: stable without l2norm
    v = rng.normal(size=(b, t, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv)))
    beta = rng.uniform(size=(b, t, hv))
    return _cast(dtype, q, k, v, g, beta), _state(rng, b, hv, dk, dv)


def make_delta_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    beta = rng.uniform(size=(b, t, hv))
    return _cast(dtype, q, k, v, beta), _state(rng, b, hv, dk, dv)


def make_kda_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk)))
    beta = rng.uniform(size=(b, t, hv))
    return _cast(dtype, q, k, v, g, beta), _state(rng, b, hv, dk, dv)


def make_gla_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32, per_channel=True):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk) if per_channel else (b, t, hv)))
    return _cast(dtype, q, k, v, g), _state(rng, b, hv, dk, dv)


def make_delta_product_inputs(
    seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32, n=2, gated=True
):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, n, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, n, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv)))
    beta = rng.uniform(0.0, 2.0, size=(b, t, n, hv))  # up to 2: negative eigenvalues
    q, k, v, g, beta = _cast(dtype, q, k, v, g, beta)
    return (q, k, v, g if gated else None, beta), _state(rng, b, hv, dk, dv)


def make_gdn2_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk)))
    erase = rng.uniform(0.0, 2.0, size=(b, t, hv, dk))  # up to 2: negative eigenvalues
    write = rng.uniform(size=(b, t, hv, dv))
    return _cast(dtype, q, k, v, g, erase, write), _state(rng, b, hv, dk, dv)


def make_dplr_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    """RWKV-7-like: `a = -kk`, `b = kk * c` with `kk` a unit vector and `c` in (0, 1) per
    channel, plus a little noise so `a` and `b` are not tied to each other."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    kk = rng.normal(size=(b, t, h, dk))
    kk = kk / np.linalg.norm(kk, axis=-1, keepdims=True)
    a = -kk + 0.1 * rng.normal(size=kk.shape) / np.sqrt(dk)
    bb = kk * rng.uniform(size=kk.shape)
    gk = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk)))
    return _cast(dtype, q, k, v, a, bb, gk), _state(rng, b, hv, dk, dv)


def make_precond_gdn_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    """`(q, k, v, g_atk, g, beta_atk, beta)`, the order of `chunk_precond_gated_delta_rule`."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    g_atk = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, h)))
    g = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv)))
    beta_atk = rng.uniform(size=(b, t, h))
    beta = rng.uniform(size=(b, t, hv))
    return _cast(dtype, q, k, v, g_atk, g, beta_atk, beta), _state(rng, b, hv, dk, dv)


def make_precond_kda_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    """`(q, k, v, g, g_atk, beta_atk, beta)`, the order of `chunk_precond_kda`."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    g = -np.exp(rng.uniform(-5.0, 1.0, size=(b, t, hv, dk)))
    g_atk = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, h)))
    beta_atk = rng.uniform(size=(b, t, h))
    beta = rng.uniform(size=(b, t, hv))
    return _cast(dtype, q, k, v, g, g_atk, beta_atk, beta), _state(rng, b, hv, dk, dv)


def make_momentum_inputs(seed, *, b=1, t=40, h=1, hv=2, dk=8, dv=6, dtype=jnp.float32):
    """Momentum delta rule inputs with the state `[S; M]` as `(b, hv, 2 dk, dv)`: decays of
    the memory and the momentum in (0.2, 1), beta and eta in [0, 1], a probe apart from
    the key."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, t, h, dk))
    k = 0.7 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    v = rng.normal(size=(b, t, hv, dv))
    log_alpha = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv)))
    log_mu = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv)))
    p = k + 0.3 * rng.normal(size=(b, t, h, dk)) / np.sqrt(dk)
    beta = rng.uniform(size=(b, t, hv))
    eta = rng.uniform(size=(b, t, hv))
    args = _cast(dtype, q, k, v, log_alpha, log_mu, p, beta, eta)
    return args, _state(rng, b, hv, 2 * dk, dv)


def make_gdn_inputs(key, b=2, t=37, h=2, hv=4, dk=16, dv=8, dtype=jnp.float32, state=True):
    """Random gated-delta-rule inputs from a PRNG key: `(q, k, v, g, beta, h0)`."""
    kq, kk, kv, kg, kb, ks = jr.split(key, 6)
    q = jr.normal(kq, (b, t, h, dk), dtype)
    k = 0.7 * jr.normal(kk, (b, t, h, dk), dtype) / float(np.sqrt(dk))
    v = jr.normal(kv, (b, t, hv, dv), dtype)
    g = -jnp.exp(jr.uniform(kg, (b, t, hv), dtype, minval=-5.0, maxval=0.0))
    beta = jr.uniform(kb, (b, t, hv), dtype)
    h0 = jr.normal(ks, (b, hv, dk, dv), jnp.float32) if state else None
    return q, k, v, g, beta, h0


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


def weighted_loss(o, h):
    """A fixed weighted sum of outputs and final state, so every element reaches the gradient."""
    wo = np.cos(np.arange(o.size, dtype=np.float32)).reshape(o.shape)
    wh = np.sin(np.arange(h.size, dtype=np.float32)).reshape(h.shape)
    return (o * wo).sum() + (h * wh).sum()


def directional_check(grads, loss, arrays, *, seed=0, eps=1e-6):
    """Relative errors of `grads` projected on a random direction per argument, against
    central differences of the float64 `loss(list_of_arrays) -> float` along it."""
    # A stream no input generator uses: with l2norm, the direction q itself is a null one.
    rng = np.random.default_rng([seed, 271828])
    base = [np.asarray(a, np.float64) for a in arrays]
    errors = []
    for i, (grad, a) in enumerate(zip(grads, base)):
        d = rng.normal(size=a.shape)
        plus = [b + eps * d if j == i else b for j, b in enumerate(base)]
        minus = [b - eps * d if j == i else b for j, b in enumerate(base)]
        expected = (loss(plus) - loss(minus)) / (2 * eps)
        actual = float(np.sum(np.asarray(grad, np.float64) * d))
        errors.append(abs(actual - expected) / max(abs(expected), 1e-30))
    return errors


def elementwise_check(grad, loss, arrays, i, *, eps=1e-6) -> float:
    """`rel_err` of `grad` (w.r.t. `arrays[i]`) against central differences of the float64
    `loss(list_of_arrays) -> float`, one element at a time (for small arguments: one pair
    of loss evaluations per element)."""
    base = [np.asarray(a, np.float64) for a in arrays]
    numeric = np.zeros_like(base[i])
    for idx in np.ndindex(base[i].shape):
        plus, minus = base[i].copy(), base[i].copy()
        plus[idx] += eps
        minus[idx] -= eps
        numeric[idx] = (
            loss([plus if j == i else b for j, b in enumerate(base)])
            - loss([minus if j == i else b for j, b in enumerate(base)])
        ) / (2 * eps)
    return rel_err(grad, numeric)


def value_and_grad_fn(fn, n_args, *, cp=None, zigzag=False):
    """A jitted `(*args) -> (o, h, grads)` for `fn(*args) -> (o, h)` of `n_args` arguments;
    the gradients are of a fixed weighted sum of `o` and `h` w.r.t. every argument. Build it
    once per module, so every test calling it with the same shapes shares one compilation.

    With `cp`, `fn` is a per-rank function run inside `jax.shard_map` over a mesh axis named
    `"cp"` of `cp` devices: every argument but the last is sharded over its axis 1 (the
    sequence), the last (the initial state) is replicated, and so is the final state. With
    `zigzag`, the sequence is put in zigzag order on the way in (`to_zigzag`) and back on the
    way out, so arguments, outputs and gradients are all in sequence order.
    """
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = None if cp is None else jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])

    def loss(*a):
        if mesh is None:
            o, h = fn(*a)
        else:
            seq, rep = P(None, "cp"), P()
            specs = (seq,) * (len(a) - 1) + (rep,)
            if zigzag:
                assert cp is not None
                a = (*(dcp.to_zigzag(x, cp) for x in a[:-1]), a[-1])
            o, h = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(seq, rep))(*a)
            if zigzag:
                assert cp is not None
                o = dcp.from_zigzag(o, cp)
        wo = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
        wh = jnp.sin(jnp.arange(h.size, dtype=h.dtype)).reshape(h.shape)
        return jnp.sum(o * wo) + jnp.sum(h * wh), (o, h)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(n_args)), has_aux=True))

    def call(*args):
        if mesh is not None:
            seq, rep = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P())
            args = [jax.device_put(x, seq) for x in args[:-1]] + [jax.device_put(args[-1], rep)]
        (_, (o, h)), grads = grad_fn(*args)
        return o, h, grads

    return call


# ---------------------------------------------------------------------------------------
# Parameter grids
# ---------------------------------------------------------------------------------------


def pairwise(
    axes: Sequence[Sequence[Any]],
    *,
    ids: Sequence[Callable[[Any], str]] | None = None,
    cover: Sequence[tuple[int, int]] | None = None,
    slow_cover: Sequence[tuple[int, int]] | None = None,
    fast: Callable[..., bool] | None = None,
) -> list[Any]:
    """The grid over `axes` as `pytest.param`s: a covering subset in the default run, the
    rest marked `slow`.

    The default run (`-m "not slow"`) keeps a greedy cover: every value of every axis, and
    every pair of values of the axes paired in `cover` (by default all pairs of axes),
    appears in some fast case. Without `slow_cover` every other case of the full product is
    `slow`; with it (axis pairs, as `cover`) the slow cases are a greedy cover extending the
    fast one, so that every pair of values of the axes paired in `slow_cover` meets in one
    of the two runs, and the cases in neither are left out. With `fast`, the default run's
    cases are those whose values `fast(*values)` accepts, not a greedy cover (for grids whose
    default cases are chosen by hand; `cover` is then unused). Deterministic: the same cases
    for the same arguments.
    """
    cases = list(itertools.product(*[range(len(a)) for a in axes]))
    every_pair = list(itertools.combinations(range(len(axes)), 2))

    def covered(case, axis_pairs):
        singles = {((i, case[i]),) for i in range(len(case))}
        return singles | {((i, case[i]), (j, case[j])) for i, j in axis_pairs}

    def values(case):
        return tuple(axes[i][c] for i, c in enumerate(case))

    used: dict[tuple[int, int], int] = {}  # how often each value is in a chosen case so far

    def greedy(axis_pairs, chosen: set[tuple[int, ...]]) -> set[tuple[int, ...]]:
        uncovered = set().union(*(covered(c, axis_pairs) for c in cases))
        uncovered -= set().union(set(), *(covered(c, axis_pairs) for c in chosen))
        picked: set[tuple[int, ...]] = set()
        while uncovered:
            # The most new pairs, then new values; among those, the least used values (spread
            # the cases).
            def gain(c):
                new = covered(c, axis_pairs) & uncovered
                pairs = sum(len(x) == 2 for x in new)
                return pairs, len(new) - pairs, -sum(used.get((i, v), 0) for i, v in enumerate(c))

            best = max(cases, key=gain)
            picked.add(best)
            uncovered -= covered(best, axis_pairs)
            for i, v in enumerate(best):
                used[(i, v)] = used.get((i, v), 0) + 1
        return picked

    if fast is None:
        fast_cases = greedy(every_pair if cover is None else cover, set())
    else:
        fast_cases = {c for c in cases if fast(*values(c))}
        for c in fast_cases:
            for i, v in enumerate(c):
                used[(i, v)] = used.get((i, v), 0) + 1
    slow = set(cases) - fast_cases if slow_cover is None else greedy(slow_cover, fast_cases)
    name = ids or [str] * len(axes)
    return [
        pytest.param(
            *values(c),
            id="-".join(f(v) for f, v in zip(name, values(c))),
            marks=() if c in fast_cases else (pytest.mark.slow,),
        )
        for c in cases
        if c in fast_cases or c in slow
    ]


def assert_cp_matches_loop(family, parallel, args, h0, **kw) -> None:
    """`family.chunk` under `parallel` (a `ContextParallel` with a mesh, global arrays):
    outputs and final state against the float64 token loop (<= 1e-5), and its gradients
    against central differences of the loop (<= 1e-4)."""

    def reference(args, h0):
        return family.reference(*args, initial_state=h0, l2norm=family.l2norm)

    @jax.jit
    def value_and_grad(arrays):
        def loss(arrays):
            o, h = family.chunk(*arrays[:-1], initial_state=arrays[-1], cp=parallel, **kw)
            wo = jnp.cos(jnp.arange(o.size, dtype=o.dtype)).reshape(o.shape)
            wh = jnp.sin(jnp.arange(h.size, dtype=h.dtype)).reshape(h.shape)
            return jnp.sum(o * wo) + jnp.sum(h * wh), (o, h)

        return jax.value_and_grad(loss, has_aux=True)(arrays)

    (_, (o, h)), grads = value_and_grad([*args, h0])
    expected_o, expected_h = reference(args, h0)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(h, expected_h) <= 1e-5
    errors = directional_check(
        grads, lambda a: weighted_loss(*reference(a[:-1], a[-1])), [*args, h0]
    )
    assert max(errors) <= 1e-4, errors

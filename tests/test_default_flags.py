"""Gradients under XLA's default flags, YNNPACK fusions included.

jaxlib 0.10's CPU backend sends sums of products to YNNPACK ("reduce" fusions); on rank-7 and
rank-8 products summed over a small axis (`jnp.sum(a * b, axis=4)` with `a, b` of shape
`(4, 8, 1, 2, 2, 16, 16)` is enough) these segfault or return wrong numbers, NaN included.
The library keeps the arrays of its chunk factors at low rank so that they do not (issue: a
segfault of the layer's gradient under `vmap`, NaN in Gated DeltaNet-2's `dk`). Each case runs
in a fresh process without any XLA flag of ours (a segfault fails the test, not the session)
and is checked against a float64 token-by-token loop with its backward written out by hand
(NumPy: no XLA in the reference).
"""

import os
import sys
import textwrap

import pytest

from . import _stall


# Each case compiles in a fresh process at XLA's default flags (25 to 30 s on 2 cores): the
# slow suite runs them (CI runs it).
pytestmark = pytest.mark.slow


# The reference: per value head, S <- diag(exp(g_t)) S; e = w_t * v_t - S^T (b_t * k_t);
# S <- S + k_t e^T; o_t = S^T (scale q_t). Forward and backward by hand in float64.
_REFERENCE = """
import numpy as np

def reference_grads(q, k, v, g, b, w, do, scale, h0=None):
    q, k, v, g, b, w, do = (np.asarray(x, np.float64) for x in (q, k, v, g, b, w, do))
    _, t, hv, dk = q.shape
    dv = v.shape[-1]
    s = np.zeros((hv, dk, dv)) if h0 is None else np.asarray(h0, np.float64)[0].copy()
    decays, befores, errs, states = [], [], [], []
    for i in range(t):
        decay = np.exp(g[0, i])  # (hv, dk)
        before = decay[..., None] * s
        err = w[0, i] * v[0, i] - np.einsum("hkv,hk->hv", before, b[0, i] * k[0, i])
        s = before + k[0, i][..., None] * err[:, None, :]
        decays.append(decay), befores.append(before), errs.append(err), states.append(s)
    grads = [np.zeros_like(x) for x in (q, k, v, g, b, w)]
    dq, dk_, dv_, dg, db, dw = grads
    ds = np.zeros((hv, dk, dv))
    for i in reversed(range(t)):
        qs = scale * q[0, i]
        ds = ds + qs[..., None] * do[0, i][:, None, :]
        dq[0, i] = scale * np.einsum("hkv,hv->hk", states[i], do[0, i])
        d_before = ds.copy()
        dk_[0, i] += np.einsum("hkv,hv->hk", ds, errs[i])
        d_err = np.einsum("hkv,hk->hv", ds, k[0, i])
        dw[0, i] = d_err * v[0, i]
        dv_[0, i] = d_err * w[0, i]
        bk = b[0, i] * k[0, i]
        d_before -= bk[..., None] * d_err[:, None, :]
        d_bk = -np.einsum("hkv,hv->hk", befores[i], d_err)
        db[0, i] = d_bk * k[0, i]
        dk_[0, i] += d_bk * b[0, i]
        dg[0, i] = np.sum(d_before * befores[i], axis=-1)
        ds = decays[i][..., None] * d_before
    return grads
"""


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    result = _stall.run([sys.executable, "-c", _REFERENCE + textwrap.dedent(code)], env=env)
    assert result.returncode == 0, (
        f"exit {result.returncode} under XLA's default flags\n{result.stderr[-3000:]}"
    )
    return result.stdout


_GDN2 = """
import jax, jax.numpy as jnp, jax.random as jr
import deltanet_cp

def check(H, C, initial):
    T, K, V = 64, 32, 16
    ks = jr.split(jr.key(0), 8)
    q = jr.normal(ks[0], (1, T, H, K))
    k = jr.normal(ks[1], (1, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jr.normal(ks[2], (1, T, H, V))
    g = -0.5 * jax.nn.softplus(jr.normal(ks[3], (1, T, H, K)))
    b = jax.nn.sigmoid(jr.normal(ks[4], (1, T, H, K)))
    w = jax.nn.sigmoid(jr.normal(ks[5], (1, T, H, V)))
    h0 = 0.1 * jr.normal(ks[6], (1, H, K, V)) if initial else None
    do = jr.normal(ks[7], (1, T, H, V))

    def loss(*args):
        o, _ = deltanet_cp.chunk_gdn2(*args, chunk_size=C, initial_state=h0)
        return jnp.sum(o * do)

    args = (q, k, v, g, b, w)
    grads = jax.jit(jax.grad(loss, argnums=range(6)))(*args)
    ref = reference_grads(*args, do, K**-0.5, h0)
    for name, x, r in zip("q k v g b w".split(), grads, ref):
        err = np.max(np.abs(np.asarray(x, np.float64) - r)) / np.max(np.abs(r))
        assert np.isfinite(err) and err < 1e-5, (name, err)


# Were NaN in dk (H = 1, chunk 64); a segfault at chunks of 16 and 32; dk off by O(1)
# with an initial state at H = 2.
for case in [(1, 64, False), (1, 32, False), (2, 16, True)]:
    check(*case)
print("OK")
"""


def test_gdn2_gradients():
    out = _run(_GDN2)
    assert out.split()[-1] == "OK", out


_LAYER = """
import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr
import deltanet_cp
from deltanet_cp.nn import GatedDeltaNet

# The issue's program: this segfaulted inside XLA.
layer = GatedDeltaNet(32, 2, 4, 16, 16, chunk_size=16, key=jr.key(0))
x = jr.normal(jr.key(1), (4, 128, 32))

@eqx.filter_jit
def layer_grad(layer, x):
    return jax.grad(lambda l: jnp.sum(jax.vmap(l)(x) ** 2))(layer)

grad = layer_grad(layer, x)
assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(grad))

# Its recurrence, the same shapes and the same vmap over sequences of one, against the
# reference (keys pre-normalised, value heads reading key head j // 2).
T, H, HV, K, V = 128, 2, 4, 16, 16
ks = jr.split(jr.key(2), 6)
q = jr.normal(ks[0], (4, 1, T, H, K))
k = jr.normal(ks[1], (4, 1, T, H, K))
k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
v = jr.normal(ks[2], (4, 1, T, HV, V))
g = -jax.nn.softplus(jr.normal(ks[3], (4, 1, T, HV)))
beta = jax.nn.sigmoid(jr.normal(ks[4], (4, 1, T, HV)))
do = jr.normal(ks[5], (4, 1, T, HV, V))

def loss(q, k, v, g, beta):
    rule = lambda *a: deltanet_cp.chunk_gated_delta_rule(*a, chunk_size=16)[0]
    return jnp.sum(jax.vmap(rule)(q, k, v, g, beta) * do)

grads = eqx.filter_jit(jax.grad(loss, argnums=range(5)))(q, k, v, g, beta)
for i in range(4):
    rep = lambda x: np.repeat(np.asarray(x[i]), HV // H, axis=2)
    gk = np.broadcast_to(np.asarray(g[i])[..., None], (1, T, HV, K))
    bk = np.broadcast_to(np.asarray(beta[i])[..., None], (1, T, HV, K))
    wv = np.broadcast_to(np.asarray(beta[i])[..., None], (1, T, HV, V))
    dq, dk, dv, dg, db, dw = reference_grads(rep(q), rep(k), v[i], gk, bk, wv, do[i], K**-0.5)
    ref = (
        dq.reshape(1, T, H, HV // H, K).sum(3),
        dk.reshape(1, T, H, HV // H, K).sum(3),
        dv,
        dg.sum(-1),
        db.sum(-1) + dw.sum(-1),
    )
    for name, x, r in zip("q k v g beta".split(), grads, ref):
        err = np.max(np.abs(np.asarray(x[i], np.float64) - r)) / np.max(np.abs(r))
        assert np.isfinite(err) and err < 1e-5, (name, i, err)
print("OK")
"""


def test_layer_gradient_under_vmap():
    out = _run(_LAYER)
    assert out.split()[-1] == "OK", out

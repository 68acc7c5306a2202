"""Test helpers: the independent float64 references and input generators.

Nothing here imports from `deltanet_cp`: these loops are the ground truth the library is
checked against.
"""

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np


def tree_allclose(x, y, *, rtol=1e-5, atol=1e-8):
    return eqx.tree_equal(x, y, typematch=True, rtol=rtol, atol=atol)


def rel_err(actual, expected) -> float:
    """max |actual - expected| / max |expected| (a scale-aware relative error)."""
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    denom = max(np.max(np.abs(e)), 1e-30)
    return float(np.max(np.abs(a - e)) / denom)


def gated_delta_reference(q, k, v, g, beta, *, scale=None, initial_state=None, l2norm=False):
    """The gated delta rule token by token in float64 numpy.

    q, k: (B, T, H, K); v: (B, T, HV, V); g, beta: (B, T, HV). Value head j reads key
    head j // (HV // H). Returns (o: (B, T, HV, V), final state: (B, HV, K, V)).
    """
    q, k, v, g, beta = (np.asarray(x, dtype=np.float64) for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // h
    scale = dk**-0.5 if scale is None else scale
    if l2norm:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    state = (
        np.zeros((b, hv, dk, dv))
        if initial_state is None
        else np.array(initial_state, dtype=np.float64)
    )
    kh = np.repeat(k, r, axis=2)  # value head j reads key head j // r
    qh = np.repeat(q, r, axis=2) * scale
    o = np.zeros((b, t, hv, dv))
    for ti in range(t):  # one token at a time, all batch elements and heads at once
        kt = kh[:, ti]  # (b, hv, dk)
        state = np.exp(g[:, ti])[..., None, None] * state
        predicted = np.einsum("bhkv,bhk->bhv", state, kt)
        delta = beta[:, ti][..., None] * (v[:, ti] - predicted)
        state = state + np.einsum("bhk,bhv->bhkv", kt, delta)
        o[:, ti] = np.einsum("bhkv,bhk->bhv", state, qh[:, ti])
    return o, state


def make_gdn_inputs(key, b=2, t=37, h=2, hv=4, dk=16, dv=8, dtype=jnp.float32, state=True):
    """Random gated-delta-rule inputs with sensible gate ranges."""
    kq, kk, kv, kg, kb, ks = jr.split(key, 6)
    q = jr.normal(kq, (b, t, h, dk), dtype)
    k = 0.7 * jr.normal(kk, (b, t, h, dk), dtype) / np.sqrt(dk)  # |k| < 1: stable without l2norm
    v = jr.normal(kv, (b, t, hv, dv), dtype)
    g = -jnp.exp(jr.uniform(kg, (b, t, hv), dtype, minval=-5.0, maxval=0.0))
    beta = jr.uniform(kb, (b, t, hv), dtype)
    h0 = jr.normal(ks, (b, hv, dk, dv), jnp.float32) if state else None
    return q, k, v, g, beta, h0


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


def value_and_grad_fn(fn, n_args, *, cp=None):
    """A jitted `(*args) -> (o, h, grads)` for `fn(*args) -> (o, h)` of `n_args` arguments;
    the gradients are of a fixed weighted sum of `o` and `h` w.r.t. every argument. Build it
    once per module, so every test calling it with the same shapes shares one compilation.

    With `cp`, `fn` is a per-rank function run inside `jax.shard_map` over a mesh axis named
    `"cp"` of `cp` devices: every argument but the last is sharded over its axis 1 (the
    sequence), the last (the initial state) is replicated, and so is the final state.
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = None if cp is None else jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])

    def loss(*a):
        if mesh is None:
            o, h = fn(*a)
        else:
            seq, rep = P(None, "cp"), P()
            specs = (seq,) * (len(a) - 1) + (rep,)
            o, h = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(seq, rep))(*a)
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

"""The depthwise causal convolution sequence-sharded under both layouts: against a float64
numpy convolution, gradients against one device, and its halo against the compiled HLO."""

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn import CausalConv1d

from .helpers import rel_err


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


C = 5  # channels
PIECE = 5  # tokens per zigzag piece (>= kernel_size - 1 = 3)


def _mesh(cp):
    return jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])


def conv_reference(weight, x, state):
    """`y[t, c] = sum_j weight[c, j] * xp[t + j, c]`, `xp` = `state` then `x`, in float64:
    one token at a time."""
    weight, x, state = (np.asarray(a, dtype=np.float64) for a in (weight, x, state))
    kernel = weight.shape[1]
    xp = np.concatenate([state, x], axis=0)
    y = np.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(kernel):
            y[t] += weight[:, j] * xp[t + j]
    return y, xp[xp.shape[0] - (kernel - 1) :]


def _sharded(conv: CausalConv1d, cp: int, layout, return_state: bool = True):
    """`f(weight, x, state) -> (y, new_state)` over a `cp`-device mesh, on global arrays in
    natural order: the layout's reordering happens around the `shard_map`. Without
    `return_state` the state is left out of the `shard_map` (`new_state` is `None`)."""
    mesh = _mesh(cp)
    context = dcp.ContextParallel("cp", layout=layout)

    def per_rank(weight, x, state):
        m = jax.tree.map(lambda _: weight, conv)  # the one array leaf is the weight
        y, new_state = m(x, state, cp=context)
        return (y, new_state) if return_state else (y, None)

    sharded = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(P(), P("cp"), P()),
        out_specs=(P("cp"), P() if return_state else None),
    )

    def f(weight, x, state):
        x = layout.to_layout(x, cp, axis=0)
        x = jax.reshard(x, NamedSharding(mesh, P("cp")))
        y, new_state = sharded(weight, x, state)
        y = jax.reshard(y, NamedSharding(mesh, P()))  # whole, to reorder
        return layout.from_layout(y, cp, axis=0), new_state

    return f


def _problem(key, kernel_size: int, cp: int):
    kc, kx, ks = jr.split(key, 3)
    conv = CausalConv1d(C, kernel_size, key=kc)
    x = jr.normal(kx, (2 * cp * PIECE, C))
    state = jr.normal(ks, (kernel_size - 1, C))
    return conv, x, state


@pytest.mark.parametrize("kernel_size", [1, 4])
@pytest.mark.parametrize("layout", [dcp.Zigzag(), dcp.Contiguous()], ids=["zigzag", "contig"])
@pytest.mark.parametrize(
    "cp", [1, pytest.param(2, marks=pytest.mark.slow), 4, pytest.param(8, marks=pytest.mark.slow)]
)
def test_matches_numpy(getkey, cp, layout, kernel_size):
    """Outputs and the replicated final state (the last W - 1 inputs), with a nonzero state."""
    conv, x, state = _problem(getkey(), kernel_size, cp)
    with_state, without = _sharded(conv, cp, layout), _sharded(conv, cp, layout, False)
    both = jax.jit(lambda *args: (with_state(*args), without(*args)))
    (y, new_state), (y2, none) = both(conv.weight, x, state)
    expected, expected_state = conv_reference(conv.weight, x, state)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert rel_err(y, expected) <= 1e-6
    assert new_state is not None and new_state.shape == (kernel_size - 1, C)
    np.testing.assert_array_equal(new_state, x[x.shape[0] - (kernel_size - 1) :])
    np.testing.assert_array_equal(new_state, expected_state.astype(np.float32))
    # Without the state out, the same outputs.
    assert none is None
    np.testing.assert_array_equal(y2, y)


# Cost: eager on one device (about 60 small ops); one small program under cp = 4 zigzag.
def test_packed_documents(getkey):
    """`cu_seqlens`: each document convolved from zeros (the float64 loop per document);
    the final state keeps only the last document's inputs; the same on zigzag shards."""
    conv, x, _ = _problem(getkey(), 4, 4)  # 40 tokens; documents shorter than the kernel
    cu = [0, 2, 2, 13, 21, 38, 40]
    y, state = conv(x, cu_seqlens=cu)
    zero = np.zeros((3, C))
    expected = [conv_reference(conv.weight, x[s:e], zero)[0] for s, e in zip(cu[:-1], cu[1:])]
    assert rel_err(y, np.concatenate(expected)) <= 1e-6
    np.testing.assert_array_equal(state[:1], 0)  # token 37 is the previous document's
    np.testing.assert_array_equal(state[1:], x[38:])
    mesh, layout = _mesh(4), dcp.Zigzag()
    sharded = jax.shard_map(
        lambda x: conv(x, cp=dcp.ContextParallel("cp", layout=layout), cu_seqlens=cu),
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=(P("cp"), P()),
    )
    x_cp = jax.device_put(layout.to_layout(x, 4, axis=0), NamedSharding(mesh, P("cp")))
    y_cp, state_cp = jax.jit(sharded)(x_cp)
    assert rel_err(layout.from_layout(y_cp, 4, axis=0), y) <= 1e-6
    np.testing.assert_array_equal(state_cp, state)


def test_halo_matters(getkey):
    """Each zigzag piece convolved from zeros instead of its halo is far from the truth, so
    the parity above checks every hand-off."""
    cp = 4
    conv, x, state = _problem(getkey(), 4, cp)
    expected, _ = conv_reference(conv.weight, x, state)
    pieces = x.reshape(2 * cp, PIECE, C)
    alone = jax.vmap(lambda p: conv(p)[0])(pieces).reshape(x.shape)
    for p in range(2 * cp):
        block = slice(p * PIECE, (p + 1) * PIECE)
        assert rel_err(alone[block], expected[block]) > 1e-2, p


@pytest.mark.parametrize(
    "cp, kernel_size",
    [(4, 4), (2, 1), *(pytest.param(*c, marks=pytest.mark.slow) for c in [(2, 4), (4, 1)])],
)
def test_zigzag_gradients(getkey, cp, kernel_size):
    """Gradients of a loss of the outputs and the final state, w.r.t. the weight, the input
    and the state, equal one device's."""
    conv, x, state = _problem(getkey(), kernel_size, cp)
    w_y = jr.normal(getkey(), x.shape)
    w_s = jr.normal(getkey(), state.shape)

    def one_device(weight, x, state):
        m = jax.tree.map(lambda _: weight, conv)
        return m(x, state)

    def loss(apply):
        def f(weight, x, state):
            y, new_state = apply(weight, x, state)
            assert new_state is not None
            return jnp.sum(y * w_y) + jnp.sum(new_state * w_s)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    expected = loss(one_device)(conv.weight, x, state)
    found = loss(_sharded(conv, cp, dcp.Zigzag()))(conv.weight, x, state)
    for name, a, e in zip(("weight", "x", "state"), found, expected):
        assert a.shape == e.shape, name
        assert rel_err(a, e) <= 1e-6, name
    # The one-device input gradient is the adjoint convolution, in float64.
    dx = np.zeros((x.shape[0] + kernel_size - 1, C))
    weight = np.asarray(conv.weight, dtype=np.float64)
    for t in range(x.shape[0]):
        for j in range(kernel_size):
            dx[t + j] += weight[:, j] * np.asarray(w_y[t], dtype=np.float64)
    dx[dx.shape[0] - (kernel_size - 1) :] += np.asarray(w_s, dtype=np.float64)
    assert rel_err(expected[1], dx[kernel_size - 1 :]) <= 1e-6


def test_errors(getkey, without_runtime_typecheck):
    conv = CausalConv1d(C, 4, key=getkey())
    # Pieces of 2 tokens: each needs kernel_size - 1 = 3.
    cp = 4
    x = jr.normal(getkey(), (2 * cp * 2, C))
    with pytest.raises(ValueError, match=r"at least kernel_size - 1 = 3 tokens in each piece"):
        jax.jit(_sharded(conv, cp, dcp.Zigzag()))(conv.weight, x, None)
    # The contiguous layout takes 4 tokens per rank (then every rank has 3).
    jax.jit(_sharded(conv, cp, dcp.Contiguous()))(conv.weight, x, None)

    # An odd shard cannot be cut into two pieces, whatever the kernel.
    mesh = _mesh(2)
    for kernel_size in [1, 4]:
        m = CausalConv1d(C, kernel_size, key=getkey())
        f = jax.shard_map(
            lambda x: m(x, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag()))[0],
            mesh=mesh,
            in_specs=P("cp"),
            out_specs=P("cp"),
        )
        with pytest.raises(ValueError, match="must be even"):
            f(jax.device_put(jr.normal(getkey(), (2 * 7, C)), NamedSharding(mesh, P("cp"))))

    # `cp` is a ContextParallel without a mesh: the layer runs inside the user's shard_map.
    with pytest.raises(TypeError, match="must be a deltanet_cp.ContextParallel"):
        conv(x, cp="cp")  # pyright: ignore[reportArgumentType]
    with pytest.raises(ValueError, match="takes no `mesh`"):
        conv(x, cp=dcp.ContextParallel("cp", mesh=mesh))


def _hlo(conv: CausalConv1d, cp: int, t: int, return_state: bool) -> str:
    """The compiled program of the zigzag convolution; without `return_state` the final
    state is computed but not returned."""
    mesh = _mesh(cp)
    context = dcp.ContextParallel("cp", layout=dcp.Zigzag())

    def per_rank(x):
        y, state = conv(x, cp=context)
        return (y, state) if return_state else y

    f = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=P("cp"),
        out_specs=(P("cp"), P()) if return_state else P("cp"),
    )
    x = jax.device_put(jnp.zeros((t, conv.channels)), NamedSharding(mesh, P("cp")))
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert hlo is not None
    return hlo


@pytest.mark.parametrize("cp", [2, 4])
def test_hlo_zigzag_halo(getkey, cp):
    """Two collective-permutes of (W - 1, channels), one forward and one backward; no
    all-gather; per-rank bytes independent of the sequence length. An unused final state
    costs no collective."""
    conv = CausalConv1d(C, 4, key=getkey())
    halo = 3 * C * 4  # (W - 1) x channels float32 elements, in bytes
    if cp == 4:
        expected = {0: halo, 1: 2 * halo, 2: 2 * halo, 3: halo}
    else:
        expected = {0: halo, 1: halo}
    for t in [2 * cp * 4, 2 * cp * 64]:
        hlo = _hlo(conv, cp, t, return_state=False)
        found = dcp.internal.collectives(hlo)
        assert [c.kind for c in found] == ["collective-permute"] * 2, found
        assert all(c.shapes == ((3, C),) and c.dtypes == ("f32",) for c in found), found
        # First-piece tails go r -> r + 1, second-piece tails r + 1 -> r.
        assert sorted(sorted(c.received) for c in found) == sorted(
            [list(range(1, cp)), list(range(cp - 1))]
        ), found
        assert dcp.internal.received_bytes_per_rank(hlo) == expected, t

    # The final state adds one all-reduce of (W - 1, channels), and nothing else.
    found = dcp.internal.collectives(_hlo(conv, cp, 2 * cp * 4, return_state=True))
    assert sorted(c.kind for c in found) == ["all-reduce", *["collective-permute"] * 2], found
    assert all(c.shapes == ((3, C),) for c in found), found


def test_hlo_no_halo_for_kernel_size_1(getkey):
    conv = CausalConv1d(C, 1, key=getkey())
    assert dcp.internal.collectives(_hlo(conv, 4, 32, return_state=True)) == []

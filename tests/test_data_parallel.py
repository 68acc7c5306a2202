"""Gradients with the batch sharded over a data-parallel mesh axis `"dp"`: alone, beside
context parallelism inside `jax.shard_map` (both layouts, every exchange), and in the mesh
form `ContextParallel(mesh=, batch_axis=)`; from the default zero state, from a state
sharded with the batch and from one replicated over `"dp"`; with packed documents. For
every recurrence of the registry, the layers and the models, each against one device's
gradients (whose own correctness tests/test_recurrences.py checks against the float64
loops).

Compilation dominates: each recurrence compiles one sharded program covering several
configurations and one single-device program. The slow grid runs every exchange and state on
the layout a family's default case does not use: with the default run, every family meets both
layouts and each layout every exchange.
"""

import contextlib
import dataclasses
import functools as ft
from typing import Any, get_args

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp import nn
from deltanet_cp.nn._hybrid import MixerKind

from .helpers import rel_err
from .registry import EXCHANGES, FAMILIES, Family


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")

CHUNK = 8
DP, CP = 2, 2
# 32 tokens: 16 per rank (two chunks), zigzag pieces of 8; one batch row per "dp" rank.
SHAPE = dict(b=DP, t=32, h=1, hv=2, dk=8, dv=6)
# Packed documents crossing the ranks' and the zigzag pieces' boundaries, one empty.
DOCS = (0, 5, 19, 19, 32)
NUM_DOCS = len(DOCS) - 1


def _mesh():
    """`("dp", "cp")`; without context parallelism the sequence is not sharded over `"cp"`
    (so one program holds every configuration of a recurrence). `Auto` axes: the mesh
    form runs on them (see `deltanet_cp._mesh`), and one program has one kind of mesh."""
    devices = jax.devices()[: DP * CP]
    return jax.make_mesh((DP, CP), ("dp", "cp"), devices=devices, axis_types=(AxisType.Auto,) * 2)


def _options(family: Family) -> dict:
    return dict(chunk_size=CHUNK, **({"use_qk_l2norm": True} if family.l2norm else {}))


def _weights(shape, phase: float) -> jax.Array:
    """Fixed loss weights, so every element reaches the gradient."""
    size = int(jnp.prod(jnp.asarray(shape)))
    return jnp.cos(jnp.arange(size, dtype=jnp.float32) + phase).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Config:
    """One way to run a recurrence with the batch over `"dp"`.

    - `form`: `"dp"` (`shard_map`, the batch over `"dp"`, no context parallelism), `"dpcp"`
        (`shard_map` over `("dp", "cp")`), `"mesh"` (`ContextParallel(mesh=, batch_axis=)`
        on global arrays).
    - `state`: `"zeros"` (the default), `"sharded"` (one per batch row, or per document),
        `"replicated"` (the same on every `"dp"` rank; `shard_map` forms only).
    - `layout`, `exchange`: of the context parallelism (forms `"dpcp"` and `"mesh"`).
    - `packed`: `DOCS` packed in each `"dp"` rank's batch row (`shard_map` forms only).
    - `defaults`: the optional arguments left out (`None`: the defaults made inside).
    """

    form: str
    state: str = "zeros"
    layout: Any = dcp.Contiguous()
    exchange: Any = dcp.AllGather()
    packed: bool = False
    defaults: bool = False

    def __repr__(self) -> str:
        cp = "" if self.form == "dp" else f"-{type(self.layout).__name__}-{self.exchange!r}"
        extra = ("-packed" if self.packed else "") + ("-defaults" if self.defaults else "")
        return f"{self.form}{cp}-{self.state}{extra}"

    def context(self) -> dcp.ContextParallel | None:
        if self.form == "dp":
            return None
        mesh = _mesh() if self.form == "mesh" else None
        batch_axis = "dp" if self.form == "mesh" else None
        return dcp.ContextParallel(
            "cp", mesh=mesh, batch_axis=batch_axis, layout=self.layout, exchange=self.exchange
        )


def _states(family: Family, h0: jax.Array) -> dict:
    """The initial states by `(state, packed)`, global: a sharded state holds every batch
    row's (every document's of every row, packed), a replicated one one `"dp"` rank's."""
    docs = 0.5 * jr.normal(jr.key(7), (DP * NUM_DOCS, *h0.shape[1:]), h0.dtype)
    return {
        ("sharded", False): h0,
        ("replicated", False): h0[: SHAPE["b"] // DP],
        ("sharded", True): docs,
        ("replicated", True): docs[:NUM_DOCS],
    }


def _final_shape(family: Family, h0: jax.Array, packed: bool) -> tuple[int, ...]:
    return (DP * NUM_DOCS, *h0.shape[1:]) if packed else h0.shape


def _one_device_loss(family: Family, config: Config):
    """The loss of `config` on one device: `(args, h0, weights) -> scalar`."""

    def loss(args, h0, weights):
        wo, wh = weights
        if not config.packed:
            if config.state == "replicated":
                h0 = jnp.concatenate([h0] * DP)
            o, h = family.chunk(*args, initial_state=h0, **_options(family))
        else:  # the rows one after the other, their documents packed in one row
            b, t = SHAPE["b"], SHAPE["t"]
            cu = [*DOCS, *(i * t + d for i in range(1, b) for d in DOCS[1:])]
            if config.state == "replicated":
                h0 = jnp.concatenate([h0] * DP)
            row = [None if a is None else a.reshape(1, b * t, *a.shape[2:]) for a in args]
            o, h = family.chunk(*row, cu_seqlens=cu, initial_state=h0, **_options(family))
            o = o.reshape(b, t, *o.shape[2:])
        return jnp.sum(o * wo) + jnp.sum(h * wh)

    return loss


def _sharded_loss(family: Family, config: Config):
    """The loss of `config` with the batch over `"dp"`: `(args, h0, weights) -> scalar`."""
    cp = config.context()
    kw = dict(_options(family), cp=cp, **({"cu_seqlens": list(DOCS)} if config.packed else {}))

    def global_loss(args, h0, weights):
        o, h = family.chunk(*args, initial_state=h0, **kw)
        return jnp.sum(o * weights[0]) + jnp.sum(h * weights[1])

    if config.form == "mesh":
        return global_loss
    mesh = _mesh()
    n = 1 if cp is None else CP
    seq_axes = ("dp",) if cp is None else ("dp", "cp")
    seq = P(*seq_axes)
    state = P() if config.state == "replicated" else P("dp")

    def per_rank(args, h0, wo, wh):
        o, h = family.chunk(*args, initial_state=h0, **kw)
        # The final state is the same on every "cp" rank: summed over "dp" only.
        return jax.lax.psum(jnp.sum(o * wo), seq_axes) + jax.lax.psum(jnp.sum(h * wh), "dp")

    def loss(args, h0, weights):
        wo, wh = weights
        layout = config.layout
        args = [None if a is None else layout.to_layout(a, n) for a in args]
        wo = layout.to_layout(wo, n)
        if h0 is None:  # the default state: nothing to hand the shard_map
            fn = jax.shard_map(
                lambda args, wo, wh: per_rank(args, None, wo, wh),
                mesh=mesh,
                in_specs=(seq, seq, P("dp")),
                out_specs=P(),
            )
            return fn(args, wo, wh)
        fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq, state, seq, P("dp")), out_specs=P())
        return fn(args, h0, wo, wh)

    return loss


def _place(config: Config, args, h0, weights):
    """The arrays placed as the `shard_map` forms' `in_specs` say (the mesh form places
    them itself)."""
    if config.form == "mesh":
        return args, h0, weights
    mesh = _mesh()

    def put(x, spec):
        return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))

    # (in sequence order: under `Zigzag` the loss reorders them, under `jax.jit`)
    seq = P("dp") if config.form == "dp" else P("dp", "cp")
    state = P() if config.state == "replicated" else P("dp")
    args = [put(a, seq) for a in args]
    return args, put(h0, state), (put(weights[0], seq), put(weights[1], P("dp")))


@ft.cache
def _grads(family: Family, configs: tuple[Config, ...], sharded: bool):
    """Every config's gradients w.r.t. the arguments and the initial state (`None` for the
    default) in one compiled program: with the batch over `"dp"`, or on one device."""
    make = _sharded_loss if sharded else _one_device_loss
    losses = [make(family, c) for c in configs]

    @jax.jit
    def grads(per_config):
        return [
            jax.grad(loss, argnums=(0, 1))(*inputs)
            if inputs[1] is not None
            else (jax.grad(loss)(*inputs), None)
            for loss, inputs in zip(losses, per_config)
        ]

    return grads


def _reference_key(config: Config) -> Config:
    """The one-device run `config` is compared with: only the state and the documents
    matter there."""
    return Config("one device", config.state, packed=config.packed, defaults=config.defaults)


def _inputs(family: Family, configs: tuple[Config, ...], seed: int):
    args, h0 = family.make(seed, **SHAPE)
    states = _states(family, h0)
    names = family.arg_names
    per_config = []
    for c in configs:
        state = None if c.state == "zeros" else states[c.state, c.packed]
        wo = _weights(tuple(SHAPE[n] for n in ("b", "t", "hv", "dv")), 0.0)  # the outputs''
        wh = _weights(_final_shape(family, h0, c.packed), 1.0)
        given = [None if c.defaults and n in family.optional else a for n, a in zip(names, args)]
        per_config.append((given, state, (wo, wh)))
    return per_config


@contextlib.contextmanager
def _one_block():
    """The engine's default block as large as any sequence here while a one-device
    reference is traced: a smaller program, quicker to compile. (The sharded programs keep
    the suite's blocks of two chunks; tests/test_recurrences.py checks that block sizes
    agree.)"""
    from deltanet_cp import _run

    saved = dict(_run._DEFAULT_BLOCK_SIZE)
    _run._DEFAULT_BLOCK_SIZE.update({k: 1 << 20 for k in saved})
    try:
        yield
    finally:
        _run._DEFAULT_BLOCK_SIZE.update(saved)


def assert_data_parallel_grads(family: Family, configs: tuple[Config, ...], seed: int = 41):
    """Each config's gradients (arguments and initial state) with the batch over `"dp"`
    equal one device's within 1e-5 (relative to the largest), in two compiled programs."""
    references = tuple(dict.fromkeys(_reference_key(c) for c in configs))
    with _one_block():
        one_device = _grads(family, references, False)(_inputs(family, references, seed))
    expected = dict(zip(references, one_device))
    per_config = _inputs(family, configs, seed)
    placed = [_place(c, *inputs) for c, inputs in zip(configs, per_config)]
    got = _grads(family, configs, True)(placed)
    names = (*family.arg_names, "initial_state")
    for config, (g_args, g_h0) in zip(configs, got):
        e_args, e_h0 = expected[_reference_key(config)]
        assert (g_h0 is None) == (e_h0 is None)
        for name, a, b in zip(names, [*g_args, g_h0], [*e_args, e_h0]):
            assert (a is None) == (b is None), (config, name)
            if b is not None:
                assert rel_err(a, b) <= 1e-5, (config, name, rel_err(a, b))


# One configuration per recurrence in the default run, together covering every form, state,
# layout and exchange, packed documents with each kind of state, and optional arguments
# left out; each of them failed before the fix. (A state sharded with the batch, which
# worked, is in the slow grid.)
_C, _Z = dcp.Contiguous(), dcp.Zigzag()
_AG, _PP, _RING, _AUTO = EXCHANGES
_DEFAULT = {
    "gated_delta_rule": Config("dp"),  # the report: shard_map over "dp", no state
    "delta_rule": Config("dpcp", "zeros", _C, _AG, packed=True),
    "kimi_delta_attention": Config("mesh", "zeros", _C, _AG),
    "gla": Config("dpcp", "sharded", _Z, _AG, packed=True),
    "gla_per_head": Config("dpcp", "replicated", _C, _AUTO, packed=True),
    "gated_delta_product": Config("mesh", "zeros", _Z, _RING),
    "gdn2": Config("dp", "replicated"),
    "dplr": Config("dpcp", "zeros", _Z, _RING),
    "precond_gated_delta_rule": Config("dpcp", "zeros", _Z, _AUTO),
    "precond_kda": Config("dpcp", "replicated", _C, _PP),
    "momentum_delta_rule": Config("mesh", "zeros", _C, _PP, defaults=True),
}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_gradients_with_batch_over_dp(family):
    assert_data_parallel_grads(family, (_DEFAULT[family.name],))


def _grid(family: Family, layout, i: int) -> tuple[Config, ...]:
    """Family `i`'s slow configurations on `layout`, chosen pairwise rather than as the whole
    cross product: two exchanges inside `shard_map` (`i` and `i + 2` of the four, so that the
    families of a layout meet every exchange between them), from two of the three states,
    one of them with packed documents; the mesh form with a third exchange; `"dp"` alone
    from one state (each family the next); and the optional arguments left out. The engine's
    exchanges are one code path for every recurrence: what differs per family is its
    arguments, states and documents, which every family meets here or in its default case.
    (The whole cross product, seven to ten configurations per family, compiled 2.2x
    longer.)"""
    states = ("zeros", "sharded", "replicated")
    configs = [
        Config("dpcp", states[(i + j) % 3], layout, EXCHANGES[(i + 2 * j) % 4], packed=j == i % 2)
        for j in range(2)
    ]
    configs.append(Config("mesh", states[i % 2], layout, EXCHANGES[(i + 1) % 4]))
    if isinstance(layout, dcp.Contiguous):
        configs.append(Config("dp", states[(i + 2) % 3]))
    if family.optional:
        configs.append(Config("dpcp", "zeros", layout, EXCHANGES[1], defaults=True))
    return tuple(configs)


def _grid_cases():
    """Each family on one layout, the one its default case does not run (alternating where
    the default has none): with the default run, every family meets both layouts, and each
    layout every exchange and state for half of the families."""
    cases = []
    for i, family in enumerate(FAMILIES):
        default = _DEFAULT[family.name]
        if default.form == "dp":  # no layout
            layout = (_C, _Z)[i % 2]
        else:
            layout = _C if isinstance(default.layout, dcp.Zigzag) else _Z
        cases.append(pytest.param(family, layout, i, id=f"{family.name}-{type(layout).__name__}"))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("family, layout, i", _grid_cases())
def test_gradients_with_batch_over_dp_grid(family, layout, i):
    assert_data_parallel_grads(family, _grid(family, layout, i))


def test_the_slow_grid_covers_every_exchange_state_and_form():
    """Between them, the default cases and the slow grid run every exchange on both layouts,
    every state in each `shard_map` form, and packed documents on both layouts."""
    configs = list(_DEFAULT.values())
    for param in _grid_cases():
        family, layout, i = param.values
        configs += _grid(family, layout, i)
    runs = {(c.form, c.state, type(c.layout).__name__, type(c.exchange).__name__) for c in configs}
    for layout in ("Contiguous", "Zigzag"):
        for exchange in EXCHANGES:
            name = type(exchange).__name__
            assert any(r[0] != "dp" and r[2:] == (layout, name) for r in runs), (layout, name)
        assert any(
            c.packed and c.form != "dp" and type(c.layout).__name__ == layout for c in configs
        ), layout
    for form in ("dp", "dpcp"):
        for state in ("zeros", "sharded", "replicated"):
            assert any(r[:2] == (form, state) for r in runs), (form, state)


# ---------------------------------------------------------------------------------------
# The layers and the models
# ---------------------------------------------------------------------------------------


def _over_dp_cp(per_row, layout, cp: dcp.ContextParallel | None, with_state: bool = False):
    """`loss(params, x, w[, state])`: `per_row(params, x, w[, state], cp)` (one sequence)
    summed over the batch, inside `shard_map` over `("dp", "cp")` (the batch over `"dp"`,
    time over `"cp"` in `layout`'s order, the parameters replicated); on one device without
    `cp`. `x`, `w` in sequence order, `(B, T, ...)`; `state` one per batch row."""

    def rows(params, x, w, *state):
        return jnp.sum(jax.vmap(lambda *a: per_row(params, *a, cp))(x, w, *state))

    if cp is None:
        return rows
    seq = P("dp", "cp")

    def local(params, x, w, *state):
        return jax.lax.psum(rows(params, x, w, *state), ("dp", "cp"))

    def loss(params, x, w, *state):
        x, w = layout.to_layout(x, CP), layout.to_layout(w, CP)
        specs = (P(), seq, seq) + ((P("dp"),) if with_state else ())
        return jax.shard_map(local, mesh=_mesh(), in_specs=specs, out_specs=P())(
            params, x, w, *state
        )

    return loss


def _layers():
    from deltanet_cp.nn import CausalConv1d, CausalSelfAttention, GatedDeltaNet

    from .test_layer import with_slow_decays

    keys = jr.split(jr.key(3), 5)
    gdn = GatedDeltaNet(32, 2, 4, 8, 4, chunk_size=CHUNK, key=keys[0])
    return {
        "gdn": with_slow_decays(gdn, keys[1]),
        "attention": CausalSelfAttention(32, 4, 8, num_kv_heads=2, tile_size=4, key=keys[2]),
        "conv": CausalConv1d(32, 4, key=keys[3]),
    }


# Per layer, each call and its context parallelism: (layer, layout, exchange, options).
_LAYER_CALLS = {
    "gdn": ("gdn", _Z, _RING, {}),
    "gdn from a state": ("gdn", _C, _PP, {}),
    "attention, all-gather": ("attention", _C, _AG, {"kv_schedule": "allgather"}),
    "attention, ring": ("attention", _Z, _AG, {"kv_schedule": "ring"}),
    "conv": ("conv", _Z, _AG, {}),
}


def _layer_row(name: str, static):
    kind, _, _, options = _LAYER_CALLS[name]

    def row(params, x, w, *state_and_cp):
        *state, cp = state_and_cp
        m = eqx.combine(params, static)
        if kind == "conv":
            y = m(x, cp=cp)[0]
        elif kind == "gdn":
            y = m(x, *state, cp=cp)
        else:
            y = m(x, cp=cp, **options)
        return jnp.sum(y * w)

    return row


@ft.cache
def _layer_grads(sharded: bool, names: tuple[str, ...]):
    layers = _layers()
    losses = {}
    for name in names:
        kind, layout, exchange, _ = _LAYER_CALLS[name]
        static = eqx.partition(layers[kind], eqx.is_array)[1]
        cp = dcp.ContextParallel("cp", layout=layout, exchange=exchange) if sharded else None
        losses[name] = _over_dp_cp(_layer_row(name, static), layout, cp, "state" in name)

    @jax.jit
    def grads(inputs):
        return {
            name: jax.grad(loss, argnums=tuple(range(len(inputs[name]))))(*inputs[name])
            for name, loss in losses.items()
        }

    return grads


def _layer_inputs(sharded: bool, names: tuple[str, ...]):
    layers = _layers()
    b, t = DP, 32
    x = jr.normal(jr.key(4), (b, t, 32))
    w = _weights(x.shape, 2.0)
    gdn = layers["gdn"]
    s = gdn.init_state()
    state = type(s)(
        conv=jr.normal(jr.key(5), (b, *s.conv.shape)),
        recurrent=0.5 * jr.normal(jr.key(6), (b, *s.recurrent.shape)),
    )
    mesh = _mesh()

    def put(tree, spec):
        return jax.device_put(tree, NamedSharding(mesh, spec)) if sharded else tree

    inputs = {}
    for name in names:
        kind = _LAYER_CALLS[name][0]
        params = put(eqx.filter(layers[kind], eqx.is_array), P())
        extra = (put(state, P("dp")),) if "state" in name else ()
        inputs[name] = (params, put(x, P("dp", "cp")), put(w, P("dp", "cp")), *extra)
    return inputs


@pytest.mark.parametrize(
    "names",
    [
        ("gdn", "attention, ring", "conv"),
        pytest.param(("gdn from a state", "attention, all-gather"), marks=pytest.mark.slow),
    ],
    ids=["default", "more"],
)
def test_layers_with_batch_over_dp(names):
    # nn.GatedDeltaNet (from the default state, and from states sharded with the batch),
    # the attention layer (both key/value schedules) and the convolution, with the batch
    # over "dp" and time over "cp": every gradient (parameters, input, state) equals one
    # device's. (HybridLM's and Qwen3.5's training steps below run every layer too.)
    with _one_block():
        expected = _layer_grads(False, names)(_layer_inputs(False, names))
    got = _layer_grads(True, names)(_layer_inputs(True, names))
    for name in names:
        errors = jax.tree.map(rel_err, got[name], expected[name])
        assert max(jax.tree.leaves(errors)) <= 1e-5, (name, errors)


def _hybrid():
    """HybridLM's fixture model and batch (tests/test_hybrid.py) and its one-device step."""
    from . import test_hybrid as h

    tokens = jr.randint(jr.key(1), (h.B, h.T + 1), 0, h.VOCAB)
    mask = (jr.uniform(jr.key(2), (h.B, h.T)) < 0.7).astype(jnp.float32)
    batch = (tokens[:, :-1], tokens[:, 1:], mask)
    return h._model(), batch, h._reference_step, (dcp.Contiguous(), "ring")


def _qwen3_5():
    """The small Qwen3.5 model and batch of tests/test_qwen3_5.py and its one-device step."""
    from . import test_qwen3_5 as q

    tokens = jnp.stack([q._tokens(), q._tokens()[::-1]])
    inputs, targets = (jnp.pad(a, ((0, 0), (0, 1))) for a in (tokens[:, :-1], tokens[:, 1:]))
    mask = jnp.ones(targets.shape, jnp.float32).at[:, -1].set(0)  # the padding position
    return q._small(), (inputs, targets, mask), q._reference_step, (dcp.Zigzag(), "allgather")


def _every_kind():
    """A HybridLM with one block of each token mixer of `deltanet_cp.nn` (every recurrent
    layer and attention), a batch of two, and its one-device step."""
    mixers: list[Any] = list(get_args(MixerKind))  # every name HybridLM builds
    model = nn.HybridLM(16, 16, len(mixers), mixers=mixers, chunk_size=8, key=jr.key(9))

    # RWKV-7 zeros its output projection at initialisation (as flash-linear-attention
    # does), which would hide the rest of the layer from the gradients: a random one.
    def rwkv_out(m):
        return [b.mixer.o_proj.weight for b in m.blocks if isinstance(b.mixer, nn.RWKV7Attention)]

    rng = np.random.default_rng(12)
    weights = [0.1 * rng.standard_normal(w.shape) for w in rwkv_out(model)]
    model = eqx.tree_at(rwkv_out, model, [jnp.asarray(w, jnp.float32) for w in weights])
    tokens = jr.randint(jr.key(10), (DP, 33), 0, 16)
    mask = (jr.uniform(jr.key(11), (DP, 32)) < 0.8).astype(jnp.float32)
    batch = (tokens[:, :-1], tokens[:, 1:], mask)

    def reference_step():
        def loss(model):
            total, count = _nll(jax.vmap(model)(batch[0]), batch[1], batch[2])
            return total / count

        return eqx.filter_jit(eqx.filter_value_and_grad(loss))(model)

    return model, batch, reference_step, (dcp.Zigzag(), "ring")


def _nll(logits, targets, mask):
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.sum(picked * mask), jnp.sum(mask)


LEARNING_RATE = 0.1


# The Qwen3.5 step in the slow run (about 20 s): its mixers run the same Gated DeltaNet engine
# and attention kernel as HybridLM's, whose step the default run trains.
# HybridLM with every kind of mixer in the slow run too (two programs of twelve different
# blocks; 140 s cold on 2 busy cores with ten, 60 s with half its programs in the cache).
@pytest.mark.parametrize(
    "make",
    [
        _hybrid,
        pytest.param(_qwen3_5, marks=pytest.mark.slow),
        pytest.param(_every_kind, marks=pytest.mark.slow),
    ],
    ids=["HybridLM", "Qwen3.5", "every-mixer"],
)
def test_optax_training_step_on_dp_cp_mesh(make):
    # One optax step (SGD with momentum) with the batch over "dp" and time over "cp"
    # (inside shard_map, the parameters replicated): the loss, the gradients and the new
    # parameters equal one device's (the first step of SGD with momentum is -lr * grad).
    import optax

    model, batch, reference_step, (layout, kv_schedule) = make()
    params, static = eqx.partition(model, eqx.is_array)
    mesh, seq = _mesh(), P("dp", "cp")
    context = dcp.ContextParallel("cp", layout=layout)

    def local(params, inputs, targets, mask):
        m = eqx.combine(params, static)
        logits = jax.vmap(ft.partial(m, cp=context, kv_schedule=kv_schedule))(inputs)
        total, count = _nll(logits, targets, mask)
        return jax.lax.psum(total, ("dp", "cp")) / jax.lax.psum(count, ("dp", "cp"))

    def loss(params, batch):
        batch = [layout.to_layout(a, CP) for a in batch]
        return jax.shard_map(local, mesh=mesh, in_specs=(P(),) + (seq,) * 3, out_specs=P())(
            params, *batch
        )

    optimizer = optax.sgd(LEARNING_RATE, momentum=0.9)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, grads, optax.apply_updates(params, updates), opt_state

    params = jax.device_put(params, NamedSharding(mesh, P()))
    batch = jax.device_put(batch, NamedSharding(mesh, seq))
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        value, grads, new, _ = step(params, optimizer.init(params), batch)
    value1, grads1 = reference_step()
    assert abs(float(value) - float(value1)) <= 1e-5 * abs(float(value1))
    errors = jax.tree.map(rel_err, grads, grads1)
    assert max(jax.tree.leaves(errors)) <= 1e-5, errors
    expected = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads1)
    errors = jax.tree.map(rel_err, new, expected)
    assert max(jax.tree.leaves(errors)) <= 1e-5, errors

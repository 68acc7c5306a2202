"""The layer wing's skeleton: one options value for the engine settings, one call shape for
every token mixer, one state type for the recurrent layers (construction and argument
checks only; the numerics are the layers' own tests)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp import nn


def _mixers(key, **engine):
    return [
        nn.GatedDeltaNet(32, 2, 4, 8, 8, key=key, **engine),
        nn.DeltaNet(32, 2, 4, 8, 8, key=key, **engine),
        nn.KimiDeltaAttention(32, 2, 8, key=key, **engine),
        nn.GatedLinearAttention(32, 2, 8, 8, key=key, **engine),
        nn.SimpleGatedLinearAttention(32, 2, 8, 8, key=key, **engine),
        nn.GatedDeltaProduct(32, 2, 4, 8, 8, key=key, **engine),
        nn.GatedDeltaNet2(32, 2, 4, 8, 8, key=key, **engine),
        nn.MomentumDeltaNet(32, 2, 4, 8, 8, key=key, **engine),
        nn.PrecondGatedDeltaNet(32, 2, 4, 8, 8, key=key, **engine),
        nn.PrecondKimiDeltaAttention(32, 2, 8, key=key, **engine),
        nn.RWKV7Attention(32, 2, 8, 8, key=key, **engine),
    ]


def test_options_are_the_loose_settings(getkey):
    key = getkey()
    loose = dict(chunk_size=16, block_size=32, memory="high", precision="highest")
    options = dcp.EngineOptions(**loose)
    for a, b in zip(_mixers(key, **loose), _mixers(key, options=options)):
        assert a.options == b.options == options
        assert (a.chunk_size, a.block_size, a.memory, a.precision) == tuple(loose.values())
        leaves_a, leaves_b = (jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (a, b))
        assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
        assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(m.options == dcp.EngineOptions() for m in _mixers(key))
    assert dcp.EngineOptions().chunk_size == 64


@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(chunk_size=0), ValueError),
        (dict(chunk_size=1.0), TypeError),
        (dict(block_size=-1), ValueError),
        (dict(memory="mid"), ValueError),
        (dict(precision="fast"), ValueError),
    ],
)
def test_options_checked(bad, error):
    (name,) = bad
    with pytest.raises(error, match=f"`{name}`"):
        dcp.EngineOptions(**bad)


def test_options_and_loose_settings_not_both(getkey):
    options = dcp.EngineOptions(chunk_size=16)
    with pytest.raises(ValueError, match="not both.*`memory`"):
        nn.GatedDeltaNet(32, 2, 2, 8, 8, options=options, memory="high", key=getkey())
    with pytest.raises(ValueError, match="not both"):
        nn.HybridLM(50, 32, 1, options=options, precision="highest", key=getkey())
    with pytest.raises(TypeError, match="EngineOptions"):
        nn.DeltaNet(32, 2, 2, 8, 8, options=16, key=getkey())  # pyright: ignore[reportArgumentType]


def test_one_state_type():
    with pytest.warns(DeprecationWarning, match="RecurrentLayerState"):
        from deltanet_cp.nn import GatedDeltaNetState
    with pytest.warns(DeprecationWarning, match="RecurrentLayerState"):
        from deltanet_cp.nn import KimiDeltaAttentionState
    assert GatedDeltaNetState is KimiDeltaAttentionState is nn.RecurrentLayerState


def test_one_call_shape(getkey):
    mixers = [*_mixers(getkey()), nn.CausalSelfAttention(32, 2, 8, key=getkey())]
    assert all(isinstance(m, nn.AbstractTokenMixer) for m in mixers)
    assert all(m.first_values(jnp.zeros((4, 32))) is None for m in mixers[:-2] + mixers[-1:])
    attention = mixers[-1]
    x = jnp.zeros((4, 32))
    # Packed documents: each one as if alone (causal within it, rotary restarting).
    y = jr.normal(getkey(), (4, 32))
    alone = jnp.concatenate([attention(y[:2]), attention(y[2:])])
    assert jnp.max(jnp.abs(attention(y, cu_seqlens=[0, 2, 4]) - alone)) <= 1e-6
    with pytest.raises(ValueError, match="cu_seqlens"):
        attention(x, cu_seqlens=[0, 2, 3])
    with pytest.raises(ValueError, match="prefill"):
        attention(x, attention.init_state(capacity=8))
    with pytest.raises(ValueError, match="capacity"):
        attention.init_state()
    with pytest.raises(ValueError, match="position"):
        attention.step(x[0], attention.init_state(capacity=8))


def test_skeleton_checks_sizes():
    with pytest.raises(ValueError, match="multiple of `num_key_heads`"):
        nn.Skeleton.grouped(32, 2, 3, 8, 8)
    with pytest.raises(ValueError, match="`num_heads`"):
        nn.Skeleton(
            dict(hidden_size=32, num_heads=0, head_dim=8), heads="num_heads", dims="head_dim"
        )
    s = nn.Skeleton(
        dict(hidden_size=32, num_heads=2, head_dim=8), heads="num_heads", dims="head_dim"
    )
    assert (s.hidden_size, s.key_dim, s.value_dim, s.conv_dim) == (32, 16, 16, 48)
    assert s.options == dcp.EngineOptions()
    proj, conv = s.qkv(jr.key(0), jr.key(1))
    assert (proj.in_features, proj.out_features, conv.channels) == (32, 48, 48)


def test_one_prefill_call(getkey):
    # Every mixer continues a prompt one way, `extend(x, state, position)` (the decoder
    # layers call nothing else): a prompt run as 4 then 4 tokens gives the whole prompt's
    # output, for a recurrent layer (its state continues by itself) and for attention (its
    # cache needs the position).
    x = jr.normal(getkey(), (8, 32))

    @eqx.filter_jit
    def two_parts(m):
        state = m.init_state(capacity=8)
        a, state, _ = m.extend(x[:4], state, 0)
        b, _, saved = m.extend(x[4:], state, 4)
        return jnp.concatenate([a, b]), m(x), saved

    for m in (
        nn.GatedDeltaNet(32, 2, 4, 8, 8, key=getkey()),
        nn.CausalSelfAttention(32, 2, 8, key=getkey()),
    ):
        got, want, saved = two_parts(m)
        assert jnp.max(jnp.abs(got - want)) <= 1e-5, type(m).__name__
        assert saved is None

    class NoPrefill(nn.AbstractTokenMixer):
        def __call__(self, x, state=None, **kwargs):
            return x

        def init_state(self, dtype=None, *, capacity=None):
            return None

        def step(self, x, state, position=None, /, *, v_first=None):
            return x, state

    with pytest.raises(TypeError, match="NoPrefill has no prefill"):
        NoPrefill().extend(x, None, 0)

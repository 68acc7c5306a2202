"""`deltanet_cp.testing.check_recurrence` passes on every recurrence the library ships and on
the example's retention, and fails, naming the method, on recurrences that break a law; the
engine's own shape checks name `step` and `state`.
"""

import dataclasses
import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp import chunkops
from deltanet_cp.testing import check_recurrence, RecurrenceCheckError

from .registry import FAMILIES, Family, GATED_DELTA_RULE, GLA_PER_HEAD


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


# Compiling dominates these tests; XLA's optimisation passes only slow it (tests/_fast_compile.py).
pytestmark = pytest.mark.usefixtures("fast_compile")


def _load_example():
    spec = importlib.util.spec_from_file_location("own_recurrence", EXAMPLES / "own_recurrence.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


own = _load_example()


def _retention_inputs(t=20, b=1, h=2, dk=8, dv=4, seed=0):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    mask = jnp.asarray(rng.random((b, t)) > 0.1)
    return own.RetentionInputs(normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv), mask)


GAMMAS = (0.9, 0.6)
FAST = (GATED_DELTA_RULE, GLA_PER_HEAD)


# ---------------------------------------------------------------------------------------
# It passes on correct recurrences
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, id=f.name, marks=() if f in FAST else (pytest.mark.slow,)) for f in FAMILIES],
)
def test_builtin_recurrences_pass(family: Family):
    # 20 tokens, chunks of 8: a partial last chunk; every check, context parallelism on 2
    # devices by default and on 2 and 4 in the slow run.
    args, h0 = family.make(3, b=1, t=20, h=1, hv=2, dk=8, dv=6)
    fast = family in FAST
    errors = check_recurrence(
        family.configuration(8),
        family.inputs(*args),
        initial_state=h0,
        cp=(2,) if fast else (2, 4),
    )
    checks = ["shapes", "zero token", "affine step", "chunk_map", "compose", "chunked"]
    checks += ["gradients", "declarations", "cp=2, Contiguous", "cp=2, Zigzag"]
    if not fast:
        checks += ["cp=4, Contiguous", "cp=4, Zigzag"]
    assert list(errors) == checks
    assert max(errors.values()) <= 1e-4, errors


def test_own_recurrence_passes():
    # examples/own_recurrence.py's `check_contract`, as the guide shows it.
    errors = own.check_contract(cp=(2,))
    assert len(errors) == 9 and max(errors.values()) <= 1e-5, errors


def test_missing_devices_are_skipped_with_a_warning():
    with pytest.warns(UserWarning, match="xla_force_host_platform_device_count=64"):
        errors = check_recurrence(
            own.Retention(gammas=GAMMAS, chunk_size=8),
            _retention_inputs(),
            cp=(64,),
            gradients=False,
        )
    assert "gradients" not in errors and not any(k.startswith("cp=") for k in errors)


def test_too_short_inputs():
    with pytest.raises(ValueError, match="at least two chunks"):
        check_recurrence(own.Retention(gammas=GAMMAS, chunk_size=32), _retention_inputs(t=20))


# ---------------------------------------------------------------------------------------
# It fails, naming the method, on broken ones
# ---------------------------------------------------------------------------------------


class NonAffineOutputs(own.Retention):
    """Reads the state through a tanh: outputs not affine in `h`."""

    def step(self, factors, h):
        o = chunkops.einsum("bhck,bhkv->bchv", factors.q, jnp.tanh(h)) + factors.o
        return factors.map(h), o


class NonAffineState(own.Retention):
    """A quadratic term in the state, zero on a chunk of zero tokens."""

    def step(self, factors, h):
        h_next, o = super().step(factors, h)
        return h_next + 0.1 * jnp.sum(factors.q) ** 2 * h * h, o


class ComposeInWrongOrder(own.Retention):
    """`compose` applies the new chunk *before* the running map."""

    def compose(self, factors, running):
        return self.chunk_map(factors).then(running)


class ChunkMapDisagrees(own.Retention):
    """`chunk_map` doubles the chunk's writes that `step` makes once."""

    def chunk_map(self, factors):
        return dcp.DiagonalAffineMap(factors.map.decay, 2 * factors.map.U)


class ZeroTokenDecays(own.Retention):
    """Ignores the mask: the fixed decay acts on the engine's padding too."""

    def prepare(self, chunks):
        return super().prepare(eqx.tree_at(lambda c: c.mask, chunks, jnp.ones_like(chunks.mask)))


class OutputsHeadsFirst(own.Retention):
    """`step` returns outputs `(B, H, C, V)`, not `(B, C, H, V)`."""

    def step(self, factors, h):
        h_next, o = super().step(factors, h)
        return h_next, jnp.swapaxes(o, 1, 2)


class WrongStateK(own.Retention):
    """`state` says K + 1 rows."""

    def state(self, inputs):
        (b, _, h, dk), dv = inputs.q.shape, inputs.v.shape[-1]
        return jax.ShapeDtypeStruct((b, h, dk + 1, dv), jnp.float32)


@pytest.mark.parametrize(
    "broken, check, message",
    [
        (NonAffineOutputs, "affine step", r"step\(factors, h\) must be affine in h.*outputs"),
        (NonAffineState, "affine step", r"step\(factors, h\) must be affine in h.*next state"),
        (ComposeInWrongOrder, "compose", r"compose\(factors, running\) must equal running"),
        (ChunkMapDisagrees, "chunk_map", r"chunk_map\(factors\)\(h\) must equal step"),
        (ZeroTokenDecays, "zero token", r"step\(prepare\(zeros\), h\)\[0\].*unchanged"),
        (OutputsHeadsFirst, "shapes", r"step\(factors, h\) must return outputs with the batch"),
        (WrongStateK, "shapes", r"state\(inputs\) says the state has shape \(1, 2, 9, 4\)"),
    ],
    ids=lambda x: x.__name__ if isinstance(x, type) else None,
)
def test_broken_recurrences_fail(broken, check, message):
    with pytest.raises(RecurrenceCheckError, match=message) as info:
        check_recurrence(broken(gammas=GAMMAS, chunk_size=8), _retention_inputs(), cp=())
    assert info.value.check == check
    assert isinstance(info.value, AssertionError)
    assert broken.__name__ in str(info.value)  # names the class and the method


# ---------------------------------------------------------------------------------------
# The engine's own shape checks, at trace time
# ---------------------------------------------------------------------------------------


def test_run_names_step_for_outputs_heads_first():
    with pytest.raises(ValueError, match=r"OutputsHeadsFirst\.step\(factors, h\) must return"):
        dcp.run(OutputsHeadsFirst(gammas=GAMMAS, chunk_size=8), _retention_inputs())


def test_run_names_state_for_a_wrong_k():
    with pytest.raises(ValueError, match=r"WrongStateK\.state\(inputs\) says the state"):
        dcp.run(WrongStateK(gammas=GAMMAS, chunk_size=8), _retention_inputs())


class StepWrongDtype(own.Retention):
    def step(self, factors, h):
        h_next, o = super().step(factors, h)
        return h_next.astype(jnp.bfloat16), o


class StateWithoutBatch(own.Retention):
    def state(self, inputs):
        (_, _, h, dk), dv = inputs.q.shape, inputs.v.shape[-1]
        return jax.ShapeDtypeStruct((h, dk, dv), jnp.float32)


def test_run_names_step_for_a_wrong_state_dtype():
    with pytest.raises(ValueError, match=r"step\(factors, h\) must return the next state"):
        dcp.run(StepWrongDtype(gammas=GAMMAS, chunk_size=8), _retention_inputs())


def test_run_names_state_without_the_batch():
    with pytest.raises(ValueError, match=r"state\(inputs\) must return a jax.ShapeDtypeStruct"):
        dcp.run(StateWithoutBatch(gammas=GAMMAS, chunk_size=8), _retention_inputs())


# ---------------------------------------------------------------------------------------
# The inputs' declarations (log decays, output-only fields) against `step`
# ---------------------------------------------------------------------------------------


class UndeclaredGate(dcp.GLAInputs):
    """GLA's inputs with the log decay `g` not declared one."""

    g: jax.Array = eqx.field()  # pyright: ignore[reportIncompatibleVariableOverride]


class KeyDeclaredOutputOnly(dcp.GLAInputs):
    """GLA's inputs with the key declared output-only (it writes the state)."""

    k: jax.Array = eqx.field(metadata={"output_only": True})  # pyright: ignore[reportIncompatibleVariableOverride]


@pytest.mark.parametrize(
    "inputs_class, message",
    [
        (
            UndeclaredGate,
            r"takes -inf in `g` .* not declared one.*metadata=\{\"log_decay\": True\}",
        ),
        (KeyDeclaredOutputOnly, r"`k` is declared output_only.*other tokens' outputs"),
    ],
    ids=["undeclared-log-decay", "output-only-key"],
)
def test_wrong_declarations_fail(inputs_class, message):
    # GLA per head (its program shared with test_builtin_recurrences_pass: values change,
    # not shapes), its inputs re-declared wrongly.
    args, h0 = GLA_PER_HEAD.make(3, b=1, t=20, h=1, hv=2, dk=8, dv=6)
    good = GLA_PER_HEAD.inputs(*args)
    inputs = inputs_class(good.q, good.k, good.v, good.g)
    with pytest.raises(RecurrenceCheckError, match=message) as info:
        check_recurrence(GLA_PER_HEAD.configuration(8), inputs, initial_state=h0, cp=())
    assert info.value.check == "declarations"


def test_tolerances_follow_the_precision_policy():
    # The momentum rule with bfloat16 products keeps its laws to bfloat16 rounding (the
    # affine law's difference was 1.9e-3 of its scale, past float32's default 1e-4): the
    # default tolerances follow the recurrence's precision (a few seconds: one device, no
    # gradients).
    from .registry import MOMENTUM

    args, h0 = MOMENTUM.make(3, b=1, t=20, h=1, hv=2, dk=8, dv=6)
    recurrence = dataclasses.replace(MOMENTUM.configuration(8), precision="bfloat16")
    errors = check_recurrence(
        recurrence, MOMENTUM.inputs(*args), initial_state=h0, cp=(), gradients=False
    )
    assert 1e-4 < max(errors.values()) <= 1e-2, errors
    with pytest.raises(RecurrenceCheckError, match="affine"):
        check_recurrence(
            recurrence, MOMENTUM.inputs(*args), initial_state=h0, cp=(), gradients=False, rtol=1e-4
        )

"""The registry of recurrences the property tests run over (lineax's tests/helpers.py is
the model): a new recurrence gets the whole battery of tests/test_recurrences.py by adding
one `Family` to `FAMILIES`.

The float64 loops and input generators live in tests/helpers.py, which does not import the
library; this module pairs them with the library's public functions.
"""

import dataclasses
import functools as ft
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

import deltanet_cp as dcp
from deltanet_cp._precision import accumulation_dtype
from deltanet_cp.recurrences._cascade import engine_stage, precondition

from .helpers import (
    delta_product_reference,
    delta_reference,
    dplr_reference,
    gated_delta_reference,
    gdn2_reference,
    gla_reference,
    kda_reference,
    make_delta_inputs,
    make_delta_product_inputs,
    make_dplr_inputs,
    make_gated_delta_inputs,
    make_gdn2_inputs,
    make_gla_inputs,
    make_kda_inputs,
    make_momentum_inputs,
    make_precond_gdn_inputs,
    make_precond_kda_inputs,
    momentum_reference,
    precond_gated_delta_reference,
    precond_kda_reference,
    Reference,
)


@dataclasses.dataclass(frozen=True)
class Family:
    """One recurrence: its two public functions, its configuration, its float64 loop.

    **Fields:**

    - `name`: the test id.
    - `chunk`, `recurrent`: the public functions `chunk_X` and `recurrent_X` (both take
        `cp=` for context parallelism).
    - `recurrence`: the configuration class, `recurrence(chunk_size=, scale=, use_qk_l2norm=)`
        (without `use_qk_l2norm` where `l2norm` is false); see `configuration`.
    - `inputs`: the public positional arguments -> the engine's inputs PyTree.
    - `make`: `make(seed, *, b, t, h, hv, dk, dv, dtype) -> (args, initial_state)`, the
        arguments in public order with sensible ranges, the state `(b, hv, dk, dv)` float32.
    - `reference`: the float64 loop, `reference(*args, scale=, initial_state=, l2norm=,
        cu_seqlens=) -> (o, final_state)`.
    - `arg_names`: the public positional argument names, in order.
    - `gate`: the name of the log-decay argument, `None` if there is none.
    - `gate_per_channel`: whether that gate has one value per key channel (its last axis K).
    - `l2norm`: whether the recurrence has the `use_qk_l2norm` option.
    - `unit_gates`: the arguments that are gates in `[0, 1]` (set to 0 and 1 by the
        extreme-gate test).
    - `output_only`: the arguments that reach only their own token's outputs, neither the
        state nor other tokens (read off the loop: the query of every family here).
    - `state_rows`: the state's rows per key channel: `(b, hv, state_rows * dk, dv)` (2 for
        the momentum delta rule's `[S; M]`).
    - `optional`: the arguments that may be `None` (a default takes their place).
    - `inputs_run_a_recurrence`: `inputs(*args, cu_seqlens=, cp=)` runs a first recurrence
        (the preconditioned rules' write keys), which needs the packed documents and the
        context parallelism of the call.
    """

    name: str
    chunk: Callable[..., Any]
    recurrent: Callable[..., Any]
    recurrence: Callable[..., Any]
    inputs: Callable[..., Any]
    make: Callable[..., tuple[tuple[Any, ...], jax.Array]]
    reference: Reference
    arg_names: tuple[str, ...]
    gate: str | None
    gate_per_channel: bool = False
    l2norm: bool = True
    unit_gates: tuple[str, ...] = ()
    output_only: tuple[str, ...] = ("q",)
    state_rows: int = 1
    optional: tuple[str, ...] = ()
    inputs_run_a_recurrence: bool = False

    def __repr__(self) -> str:
        return self.name

    def configuration(self, chunk_size: int) -> Any:
        """The configuration with q/k L2 normalisation where the recurrence has it."""
        if self.l2norm:
            return self.recurrence(chunk_size=chunk_size, use_qk_l2norm=True)
        return self.recurrence(chunk_size=chunk_size)

    def gate_index(self) -> int | None:
        return None if self.gate is None else self.arg_names.index(self.gate)


def _delta_inputs(q, k, v, g, beta):
    return dcp.DeltaInputs(q, k, v, g, beta)


def _ungated_delta_inputs(q, k, v, beta):
    return dcp.DeltaInputs(q, k, v, None, beta)


def _gla_inputs(q, k, v, g):
    return dcp.GLAInputs(q, k, v, g)


def _gdn2_inputs(q, k, v, g, b, w):
    return dcp.DeltaInputs(q, k, v, g, b, w)


def _dplr_inputs(q, k, v, a, b, gk):
    return dcp.DPLRInputs(q, k, v, a, b, gk)


GATED_DELTA_RULE = Family(
    name="gated_delta_rule",
    chunk=dcp.chunk_gated_delta_rule,
    recurrent=dcp.recurrent_gated_delta_rule,
    recurrence=dcp.GatedDeltaRule,
    inputs=_delta_inputs,
    make=make_gated_delta_inputs,
    reference=gated_delta_reference,
    arg_names=("q", "k", "v", "g", "beta"),
    gate="g",
    unit_gates=("beta",),
)

DELTA_RULE = Family(
    name="delta_rule",
    chunk=dcp.chunk_delta_rule,
    recurrent=dcp.recurrent_delta_rule,
    recurrence=dcp.DeltaRule,
    inputs=_ungated_delta_inputs,
    make=make_delta_inputs,
    reference=delta_reference,
    arg_names=("q", "k", "v", "beta"),
    gate=None,
    unit_gates=("beta",),
)

KIMI_DELTA_ATTENTION = Family(
    name="kimi_delta_attention",
    chunk=dcp.chunk_kda,
    recurrent=dcp.recurrent_kda,
    recurrence=dcp.KimiDeltaRule,
    inputs=_delta_inputs,
    make=make_kda_inputs,
    reference=kda_reference,
    arg_names=("q", "k", "v", "g", "beta"),
    gate="g",
    gate_per_channel=True,
    unit_gates=("beta",),
)

GLA = Family(
    name="gla",
    chunk=dcp.chunk_gla,
    recurrent=dcp.recurrent_gla,
    recurrence=dcp.GLARule,
    inputs=_gla_inputs,
    make=make_gla_inputs,
    reference=gla_reference,
    arg_names=("q", "k", "v", "g"),
    gate="g",
    gate_per_channel=True,
)

GLA_PER_HEAD = dataclasses.replace(
    GLA,
    name="gla_per_head",
    make=ft.partial(make_gla_inputs, per_channel=False),
    gate_per_channel=False,
)

GATED_DELTA_PRODUCT = Family(
    name="gated_delta_product",
    chunk=dcp.chunk_gated_delta_product,
    recurrent=dcp.recurrent_gated_delta_product,
    recurrence=dcp.GatedDeltaProductRule,
    inputs=_delta_inputs,
    make=make_delta_product_inputs,  # n_h = 2 householder steps per token
    reference=delta_product_reference,
    arg_names=("q", "k", "v", "g", "beta"),
    gate="g",
    unit_gates=("beta",),
)

GDN2 = Family(
    name="gdn2",
    chunk=dcp.chunk_gdn2,
    recurrent=dcp.recurrent_gdn2,
    recurrence=dcp.GatedDeltaNet2Rule,
    inputs=_gdn2_inputs,
    make=make_gdn2_inputs,  # erase gates up to 2, write gates in [0, 1]
    reference=gdn2_reference,
    arg_names=("q", "k", "v", "g", "b", "w"),
    gate="g",
    gate_per_channel=True,
    unit_gates=("b", "w"),
)

DPLR = Family(
    name="dplr",
    chunk=dcp.chunk_dplr_delta_rule,
    recurrent=dcp.recurrent_dplr_delta_rule,
    recurrence=dcp.DPLRDeltaRule,
    inputs=_dplr_inputs,
    make=make_dplr_inputs,  # RWKV-7-like: a = -kk, b = kk * c, plus noise
    reference=dplr_reference,
    arg_names=("q", "k", "v", "a", "b", "gk"),
    gate="gk",
    gate_per_channel=True,
    l2norm=False,
)

# -- The preconditioned delta rules: the public functions return `(o, final_state,
# final_A_state)` and run two stages; the registry sees the main stage. Its `recurrence` is
# the main stage's configuration and `inputs` its inputs with the write keys from the
# preconditioner (default centre, range and eps, zero initial state, no l2norm: `l2norm`
# is False here, tests/test_precond.py covers it and the preconditioner's states).


def _main_state_only(fn):
    @ft.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)[:2]

    return wrapper


def _precond_inputs(q, k, v, g_atk, g, beta_atk, beta, *, cu_seqlens=None, cp=None):
    write_key, _, _ = precondition(
        k,
        g_atk,
        beta_atk,
        dtype=accumulation_dtype(q, k, v, g_atk, g, beta_atk, beta),
        use_qk_l2norm=False,
        initial_A_state=None,
        chunk_size=16,
        precision="highest",
        x=1.5,
        eps=1e-6,
        log_atk_scale=None,
        stage=engine_stage(cu_seqlens, cp, None),
        cp=cp,
        cu_seqlens=cu_seqlens,
    )
    return dcp.DeltaInputs(q, k, v, g, beta, write_key=write_key)


def _precond_kda_inputs(q, k, v, g, g_atk, beta_atk, beta, *, cu_seqlens=None, cp=None):
    return _precond_inputs(q, k, v, g_atk, g, beta_atk, beta, cu_seqlens=cu_seqlens, cp=cp)


PRECOND_GATED_DELTA_RULE = Family(
    name="precond_gated_delta_rule",
    chunk=_main_state_only(dcp.chunk_precond_gated_delta_rule),
    recurrent=_main_state_only(dcp.recurrent_precond_gated_delta_rule),
    recurrence=dcp.PrecondGatedDeltaRule,
    inputs=_precond_inputs,
    make=make_precond_gdn_inputs,
    reference=precond_gated_delta_reference,
    arg_names=("q", "k", "v", "g_atk", "g", "beta_atk", "beta"),
    gate="g",
    l2norm=False,
    unit_gates=("beta_atk", "beta"),
    inputs_run_a_recurrence=True,
)

PRECOND_KDA = Family(
    name="precond_kda",
    chunk=_main_state_only(dcp.chunk_precond_kda),
    recurrent=_main_state_only(dcp.recurrent_precond_kda),
    recurrence=dcp.PrecondKimiDeltaRule,
    inputs=_precond_kda_inputs,
    make=make_precond_kda_inputs,
    reference=precond_kda_reference,
    arg_names=("q", "k", "v", "g", "g_atk", "beta_atk", "beta"),
    gate="g",
    gate_per_channel=True,
    l2norm=False,
    unit_gates=("beta_atk", "beta"),
    inputs_run_a_recurrence=True,
)

# The momentum delta rule. Its public functions take and return flash-linear-attention's
# stacked (2, B, HV, K, V) state; the property tests hand every family the engine's
# (B, HV, 2K, V), so these adapters restack it (exact: no arithmetic). The public layout
# itself is tested in tests/test_momentum.py.


def _momentum_public(fn):
    @ft.wraps(fn)
    def call(*args, initial_state=None, **kwargs):
        if initial_state is not None:
            dk = initial_state.shape[-2] // 2
            s0, m0 = initial_state[..., :dk, :], initial_state[..., dk:, :]
            initial_state = jnp.stack([s0, m0]) if s0.shape == m0.shape else initial_state
        o, final = fn(*args, initial_state=initial_state, **kwargs)
        return o, jnp.concatenate([final[0], final[1]], axis=-2)

    return call


def _momentum_inputs(q, k, v, log_alpha, log_mu, p, beta, eta):
    return dcp.MomentumInputs(q, k, v, p, log_alpha, log_mu, beta, eta)


MOMENTUM = Family(
    name="momentum_delta_rule",
    chunk=_momentum_public(dcp.chunk_momentum_delta_rule),
    recurrent=_momentum_public(dcp.recurrent_momentum_delta_rule),
    recurrence=dcp.MomentumDeltaRule,
    inputs=_momentum_inputs,
    make=make_momentum_inputs,
    reference=momentum_reference,
    arg_names=("q", "k", "v", "log_alpha", "log_mu", "p", "beta", "eta"),
    gate="log_alpha",
    unit_gates=("beta", "eta"),
    state_rows=2,
    optional=("p", "beta", "eta"),
)

FAMILIES = [
    GATED_DELTA_RULE,
    DELTA_RULE,
    KIMI_DELTA_ATTENTION,
    GLA,
    GLA_PER_HEAD,
    GATED_DELTA_PRODUCT,
    GDN2,
    DPLR,
    PRECOND_GATED_DELTA_RULE,
    PRECOND_KDA,
    MOMENTUM,
]
DELTA_FAMILIES = [
    GATED_DELTA_RULE,
    DELTA_RULE,
    KIMI_DELTA_ATTENTION,
    GATED_DELTA_PRODUCT,
    GDN2,
    PRECOND_GATED_DELTA_RULE,
    PRECOND_KDA,
]

EXCHANGES = [dcp.AllGather(), dcp.PPermute(), dcp.Ring(), dcp.Auto()]
EXCHANGE_NAMES = ["allgather", "ppermute", "ring", "auto"]


def exchange_id(exchange) -> str:
    return exchange if isinstance(exchange, str) else f"{type(exchange).__name__}()"

"""Checked by pyright in `tests/test_typecheck.py`, never run.

The typed engine, `run_contiguous`, accepts only `ContextParallel[Contiguous]`, so the
lines marked "expect-error" below must be reported by pyright and nothing else may be: the
public functions and `run` accept a `ContextParallel` of any layout (a zigzag one, one of
your own), and an exchange of your own. This folder has its
own pyright config, so the repository's pyright run does not see the deliberate errors.
"""

from jaxtyping import Array

import deltanet_cp as dcp


def contiguous(q: Array, k: Array, v: Array, g: Array, beta: Array):
    cp = dcp.ContextParallel("cp", layout=dcp.Contiguous())
    return dcp.chunk_gated_delta_rule(q, k, v, g, beta, cp=cp)


def default(q: Array, k: Array, v: Array, g: Array, beta: Array):
    return dcp.chunk_gated_delta_rule(q, k, v, g, beta, cp=dcp.ContextParallel("cp"))


def zigzag(q: Array, k: Array, v: Array, g: Array, beta: Array):
    cp = dcp.ContextParallel("cp", layout=dcp.Zigzag(), exchange="ring")
    return dcp.chunk_gated_delta_rule(q, k, v, g, beta, cp=cp)


def run_zigzag(inputs: dcp.DeltaInputs):
    return dcp.run(dcp.GatedDeltaRule(), inputs, cp=dcp.ContextParallel("cp", layout=dcp.Zigzag()))


def engine_default(inputs: dcp.DeltaInputs):
    return dcp.internal.run_contiguous(dcp.GatedDeltaRule(), inputs, cp=dcp.ContextParallel("cp"))


def engine_contiguous(inputs: dcp.DeltaInputs):
    cp = dcp.ContextParallel("cp", layout=dcp.Contiguous(), exchange=dcp.PPermute())
    return dcp.internal.run_contiguous(dcp.GatedDeltaRule(), inputs, cp=cp)


def engine_zigzag(inputs: dcp.DeltaInputs):
    cp = dcp.ContextParallel("cp", layout=dcp.Zigzag())
    return dcp.internal.run_contiguous(dcp.GatedDeltaRule(), inputs, cp=cp)  # expect-error


def engine_zigzag_inline(inputs: dcp.DeltaInputs):
    z, rule, engine = dcp.Zigzag(), dcp.GatedDeltaRule(), dcp.internal.run_contiguous
    return engine(rule, inputs, cp=dcp.ContextParallel("cp", layout=z))  # expect-error


class Reversed(dcp.AbstractLayout):
    def held(self, cp: int) -> tuple[tuple[int, ...], ...]:
        return tuple((cp - 1 - r,) for r in range(cp))


class Naive(dcp.AbstractExchange):
    def __call__(self, local, h0, *, axis_name, reverse=False):
        return h0, h0


def run_own_layout_and_exchange(inputs: dcp.DeltaInputs):
    cp = dcp.ContextParallel("cp", layout=Reversed(), exchange=Naive())
    return dcp.run(dcp.GatedDeltaRule(), inputs, cp=cp)


def engine_own_layout(inputs: dcp.DeltaInputs):
    cp = dcp.ContextParallel("cp", layout=Reversed())
    return dcp.internal.run_contiguous(dcp.GatedDeltaRule(), inputs, cp=cp)  # expect-error

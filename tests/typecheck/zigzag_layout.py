"""Checked by pyright in `tests/test_typecheck.py`, never run.

The engine, `run_contiguous`, accepts only a contiguous layout, so the line marked
"expect-error" below must be reported by pyright and nothing else may be: the public
context-parallel functions accept `Contiguous | Zigzag`. This folder has its own pyright
config, so the repository's pyright run does not see the deliberate error.
"""

from jaxtyping import Array

import deltanet_cp as dcp


def contiguous(q: Array, k: Array, v: Array, g: Array, beta: Array):
    return dcp.chunk_gated_delta_rule_cp(q, k, v, g, beta, axis_name="cp", layout=dcp.Contiguous())


def default(q: Array, k: Array, v: Array, g: Array, beta: Array):
    return dcp.chunk_gated_delta_rule_cp(q, k, v, g, beta, axis_name="cp")


def zigzag(q: Array, k: Array, v: Array, g: Array, beta: Array):
    return dcp.chunk_gated_delta_rule_cp(q, k, v, g, beta, axis_name="cp", layout=dcp.Zigzag())


def run_zigzag(inputs: dcp.DeltaInputs):
    return dcp.run(dcp.GatedDeltaRule(), inputs, axis_name="cp", layout=dcp.Zigzag())


def engine_contiguous(inputs: dcp.DeltaInputs):
    return dcp.run_contiguous(dcp.GatedDeltaRule(), inputs, axis_name="cp", layout=dcp.Contiguous())


def engine_zigzag(inputs: dcp.DeltaInputs):
    return dcp.run_contiguous(
        dcp.GatedDeltaRule(),
        inputs,
        axis_name="cp",
        layout=dcp.Zigzag(),  # expect-error
    )

"""Smaller traps: arguments that used to give an internal error, or a silently wrong answer.

Most of these are eager checks that compile nothing.
"""

import sys
from pathlib import Path

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp.nn import CausalConv1d
from tests import _stall


ROOT = Path(__file__).resolve().parent.parent


def test_subpackages_are_attributes():
    # In a fresh process: in this one, other tests may have imported the subpackages already.
    code = (
        "import deltanet_cp\n"
        "for name in ('nn', 'models', 'interop', 'chunkops', 'testing'):\n"
        "    getattr(deltanet_cp, name)\n"
        "deltanet_cp.nn.GatedDeltaNet, deltanet_cp.models.Qwen3_5ForCausalLM\n"
        "deltanet_cp.interop.fla.chunk_gated_delta_rule\n"
    )
    result = _stall.run([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_functions_have_flas_names():
    # One name per function, FLA's: `chunk_X` here for FLA's `chunk_X`, with `recurrent_X`
    # beside it (`help(deltanet_cp.chunk_kda)` finds the function).
    from deltanet_cp.interop import fla

    chunked = [n for n in dir(dcp) if n.startswith("chunk_")]
    assert "chunk_kda" in chunked and "recurrent_kda" in dir(dcp)
    assert not hasattr(dcp, "chunk_kimi_delta_attention")
    for name in chunked:
        assert hasattr(fla, name), name
        assert hasattr(dcp, "recurrent_" + name[len("chunk_") :]), name


def _gdn_inputs(b=1, t=8, h=1, k=4, v=4):
    q = jnp.ones((b, t, h, k)) / 2
    return q, q, jnp.ones((b, t, h, v)), -jnp.ones((b, t, h)), jnp.full((b, t, h), 0.5)


def test_context_parallel_without_mesh_outside_shard_map():
    # JAX alone says `NameError: unbound axis name: cp`.
    cp = dcp.ContextParallel("cp")
    match = r"no `mesh`.*inside `jax.shard_map`.*mesh=mesh"
    with pytest.raises(ValueError, match=match):
        dcp.chunk_gated_delta_rule(*_gdn_inputs(), cp=cp)
    with pytest.raises(ValueError, match=match):
        dcp.recurrent_gated_delta_rule(*_gdn_inputs(), cp=cp)
    recurrence, inputs = dcp.GatedDeltaRule(), dcp.DeltaInputs(*_gdn_inputs())
    with pytest.raises(ValueError, match=match):
        dcp.run_contiguous(recurrence, inputs, cp=cp)
    conv = CausalConv1d(4, 3, key=jr.key(0))
    with pytest.raises(ValueError, match=match):
        conv(jnp.ones((8, 4)), cp=cp)


def test_context_parallel_init_documents_its_arguments():
    doc = dcp.ContextParallel.__init__.__doc__ or ""
    for name in ("axis_name", "layout", "exchange", "mesh", "batch_axis"):
        assert f"- `{name}`:" in doc, name


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bandwidth=0.0),
        dict(bandwidth=-1e9),
        dict(bandwidth=float("inf")),
        dict(bandwidth=float("nan")),
        dict(bandwidth="50e9"),
        dict(latency=-1e-6),
        dict(latency=float("nan")),
        dict(latency=True),
    ],
)
def test_auto_parameters(kwargs, without_runtime_typecheck):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"`{name}` must be a finite number"):
        dcp.Auto(**kwargs)
    with pytest.raises(ValueError, match=f"`{name}` must be a finite number"):
        dcp.AllGather().estimated_seconds(4, map_elements=16, state_elements=4, **kwargs)


def test_auto_accepts_numbers(without_runtime_typecheck):
    auto = dcp.Auto(latency=0, bandwidth=np.float32(1e9))  # pyright: ignore[reportArgumentType]
    assert auto.choose(4, map_elements=16, state_elements=4)

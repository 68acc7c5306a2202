"""Smaller traps: arguments that used to give an internal error, or a silently wrong answer.

Most of these are eager checks that compile nothing.
"""

import sys
from pathlib import Path

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
    import deltanet_cp as dcp
    from deltanet_cp.interop import fla

    chunked = [n for n in dir(dcp) if n.startswith("chunk_")]
    assert "chunk_kda" in chunked and "recurrent_kda" in dir(dcp)
    assert not hasattr(dcp, "chunk_kimi_delta_attention")
    for name in chunked:
        assert hasattr(fla, name), name
        assert hasattr(dcp, "recurrent_" + name[len("chunk_") :]), name

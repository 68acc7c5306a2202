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

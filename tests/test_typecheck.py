"""Static checks: pyright refuses a zigzag (or any non-contiguous) `ContextParallel` for the
typed engine, `run_contiguous`, and accepts any layout at `run` and the public functions.
The library's own calls of the engine (`run`'s, once per pass over the walks), typed the
same way, are checked by the repository's pyright run."""

import json
import pathlib
import re
import shutil
import sys

import pytest

from . import _stall


HERE = pathlib.Path(__file__).parent


def _pyright() -> str:
    exe = shutil.which("pyright", path=str(pathlib.Path(sys.executable).parent))
    if exe is None:
        pytest.fail("pyright is not installed: it comes with the `test` extra (`make test`).")
    return exe


def test_pyright_rejects_zigzag_layout():
    path = HERE / "typecheck" / "zigzag_layout.py"
    result = _stall.run(
        [_pyright(), "--pythonpath", sys.executable, "--outputjson", str(path)],
        cwd=path.parent,  # its own pyrightconfig.json
    )
    report = json.loads(result.stdout)
    errors = [d for d in report["generalDiagnostics"] if d["severity"] == "error"]
    lines = path.read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if "# expect-error" in line}
    got = {d["range"]["start"]["line"] + 1 for d in errors}
    assert got == expected, [d["message"] for d in errors]
    for error in errors:
        assert re.search(
            r'"ContextParallel\[(Zigzag|Reversed)\]" is not assignable to '
            r'"ContextParallel\[Contiguous\]"',
            error["message"],
        ), error["message"]

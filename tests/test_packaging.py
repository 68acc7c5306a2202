"""The declared dependency floors are the ones `make test-floor` checks."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent


def test_floor_constraints_pin_the_lower_bounds():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for dep in project["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9][^,;\s]*)", dep.replace(" ", ""))
        assert m, f"a runtime dependency has a lower bound only: {dep!r}"
        bounds[m.group(1).lower()] = m.group(2)
    pins = {}
    for line in (ROOT / ".ci" / "floor-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip().lower()] = version.strip()
    assert pins == bounds, (
        ".ci/floor-constraints.txt must pin exactly pyproject.toml's lower bounds: "
        f"{pins} != {bounds}"
    )


def test_floor_tests_exist():
    # `make test-floor` runs these ids; one renamed by a grid change would fail CI there.
    listed = (ROOT / ".ci" / "floor-tests.txt").read_text().split()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *listed],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{len(listed)} tests collected" in done.stdout, done.stdout[-2000:]


def test_moved_and_renamed_names_warn_for_one_release():
    # Issue 49: the names only people extending the engine need moved to
    # `deltanet_cp.internal`, and the recurrence configurations that shared a name with a
    # layer of `deltanet_cp.nn` were renamed; the old top-level paths still work, warning.
    import warnings

    import deltanet_cp as dcp

    moved = [
        "Collective", "collectives", "DeltaFactors", "DPLRFactors",
        "GatedLinearAttentionFactors", "MomentumFactors", "pack", "received_bytes_per_rank",
        "run_contiguous", "Segments", "segments", "unpack", "Walk",
    ]  # fmt: skip
    for name in moved:
        with pytest.warns(DeprecationWarning, match=rf"deltanet_cp.internal.{name}\b"):
            assert getattr(dcp, name) is getattr(dcp.internal, name)
    renamed = {
        "GatedDeltaNet2": "GatedDeltaNet2Rule",
        "GatedDeltaProduct": "GatedDeltaProductRule",
        "GatedLinearAttention": "GLARule",
        "KimiDeltaAttention": "KimiDeltaRule",
        "PrecondKimiDeltaAttention": "PrecondKimiDeltaRule",
    }
    for old, new in renamed.items():
        with pytest.warns(DeprecationWarning, match=rf"now `deltanet_cp.{new}`"):
            assert getattr(dcp, old) is getattr(dcp, new)
        assert getattr(dcp.nn, old) is not getattr(dcp, new)  # the layer keeps its name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dcp.internal.run_contiguous and dcp.KimiDeltaRule and dcp.run
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        getattr(dcp, "no_such_name")

"""The declared dependency floors are the ones `make test-floor` checks."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path


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

"""Where the suite's time goes: XLA compilation against everything else, per test.

A pytest plugin (registered by `tests/conftest.py`). It listens to JAX's monitoring events:
the three stages of building a program (tracing to a jaxpr, lowering to StableHLO, XLA's
backend compilation) and the persistent compilation cache's requests and hits. At the end of a
run it prints one line: how many programs were compiled, the seconds spent doing it and the
cache's hit rate, summed over the test processes (pytest-xdist's workers send theirs to the
controller).

With `--suite-profile=DIR` each process also writes one JSON line per test to
`DIR/<worker>.jsonl` (wall seconds of setup + call + teardown, the compile seconds of each
stage, cache requests and hits); `python -m tests.profile_report DIR` prints the tables.
Compilation inside a test's own subprocesses is not seen here: it counts as "other".
"""

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import jax
import pytest
from jax import monitoring


_STAGES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "backend_s",
}
_COUNTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "cache_requests",
    "/jax/compilation_cache/cache_hits": "cache_hits",
}

# Since the process started, and for the test now running.
_total: defaultdict[str, float] = defaultdict(float)
_current: defaultdict[str, float] = defaultdict(float)


# The test now running's backend compilations (or loads) of half a second or more.
_current_programs: list[tuple[str, float]] = []


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
    stage = _STAGES.get(event)
    if stage is not None:
        _total[stage] += duration_secs
        _current[stage] += duration_secs
        if stage == "backend_s":
            _total["compiles"] += 1
            _current["compiles"] += 1
            if duration_secs >= 0.5:
                name = str(kwargs.get("fun_name", "?"))
                _current_programs.append((name, round(duration_secs, 2)))


def _on_event(event: str, **kwargs: str | int) -> None:
    count = _COUNTS.get(event)
    if count is not None:
        _total[count] += 1
        _current[count] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    _current_programs.clear()
    start = time.perf_counter()
    yield
    wall = time.perf_counter() - start
    directory = item.config.getoption("--suite-profile")
    if directory is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        record = {"test": item.nodeid, "wall_s": wall, **_current, "programs": _current_programs}
        path = Path(directory) / f"{worker}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: hand the totals to the controller
        workeroutput["compile_stats"] = dict(_total)


def pytest_testnodedown(node, error):
    for name, value in getattr(node, "workeroutput", {}).get("compile_stats", {}).items():
        _workers[name] += value


_workers: defaultdict[str, float] = defaultdict(float)


def pytest_terminal_summary(terminalreporter, config):
    totals = _workers if _workers else _total
    requests, hits = totals["cache_requests"], totals["cache_hits"]
    compile_s = totals["trace_s"] + totals["lower_s"] + totals["backend_s"]
    if not getattr(jax.config, "jax_compilation_cache_dir"):
        cache = "persistent cache off"
    else:
        share = f" ({100 * hits / requests:.0f}%)" if requests else ""
        cache = f"persistent cache hits {hits:.0f} of {requests:.0f}{share}"
    terminalreporter.write_line(
        f"XLA: {totals['compiles']:.0f} compilations, {compile_s:.0f} s building programs "
        f"(trace {totals['trace_s']:.0f} s, lower {totals['lower_s']:.0f} s, "
        f"compile or load {totals['backend_s']:.0f} s), {cache}"
    )

"""The examples run, and what they claim holds."""

import importlib.util
import pathlib


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_own_recurrence():
    # docs/guides/own_recurrence.md: a new recurrence in one class, on the same engine: one
    # device and packed documents vs float64 loops, context parallelism (every exchange) vs
    # one device.
    errors = _load("own_recurrence").main(b=1, t=44, h=2, dk=8, dv=4, chunk_size=8, cp=4)
    assert len(errors) == 12, errors
    assert max(errors.values()) <= 1e-5, errors

"""The examples run, and what they claim holds."""

import importlib.util
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

from . import _processes
from ._fast_compile import FAST_COMPILE_OPTIONS


EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_own_recurrence():
    # docs/guides/own_recurrence.md: a new recurrence in one class, on the same engine: one
    # device and packed documents vs float64 loops, context parallelism (every exchange) vs
    # one device; keys that read the previous token (zigzag, packed) vs the float64 loop.
    errors = _load("own_recurrence").main(b=1, t=44, h=2, dk=8, dv=4, chunk_size=8, cp=4)
    assert len(errors) == 14, errors
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.slow
def test_finetune_qwen3_5():
    # docs/guides/qwen3_5.md: fine-tuning on zigzag shards learns the task, and the
    # context-parallel prefill's checkpoints fall every 8 tokens.
    module = _load("finetune_qwen3_5")
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        result = module.main(cp=2, steps=40, verbose=False)
    losses = result["losses"]
    assert losses[-1] < losses[0] / 4, losses
    assert result["accuracy"] >= 0.75, result
    np.testing.assert_array_equal(result["checkpoints"].lengths, np.arange(8, 65, 8))


@pytest.mark.slow  # `make demo`'s programs at the default flags: 35 s cold on 2 cores
def test_demo_payloads():
    # docs/examples/demo.md, `make demo`: per layer, the Gated DeltaNet layer's busiest rank
    # receives the same bytes at two sequence lengths under both layouts and both exchanges,
    # and the attention layer's grow with the sequence (they are the other ranks' K and V).
    demo = _load("demo")
    cfg = demo.Config(seq_len=64, batch_size=1, chunk_size=16)
    short, long = 64, 256
    received = demo.payloads(cfg, cp=4, seq_lens=(short, long))
    for layout in demo.LAYOUTS:
        for column in demo.PAYLOAD_COLUMNS:
            a, b = received[short, layout, column], received[long, layout, column]
            assert a > 0, (layout, column)
            if column.startswith("GDN"):
                assert a == b, (layout, column, a, b)
            else:
                assert b == a * long // short, (layout, column, a, b)


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_train_moe():
    # docs/guides/qwen3_moe.md: the MoE model's training losses are the same with the
    # experts split four ways over the context axis (dp = 2, cp = 4 zigzag) as on one rank
    # per sequence with every expert (two training steps compiled; the losses are checked
    # against each other, so the programs compile fast).
    results = _load("train_moe").main(configs=((1, 1), (4, 4)), steps=3, verbose=False)
    one, split = (np.asarray(v) for v in results.values())
    np.testing.assert_allclose(split, one, rtol=1e-5)
    assert one[-1] < one[0], one


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_kimi_linear():
    # docs/guides/kimi_linear.md: the tiny Kimi Linear model trains on zigzag shards with
    # its experts split over the context axis, generates, and its checkpoint round-trips.
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        result = _load("kimi_linear").main(cp=2, steps=4, verbose=False)
    losses = result["losses"]
    assert losses[-1] < losses[0], losses
    assert result["generated"].shape == (8,)
    assert result["round_trip"]


@pytest.mark.slow
@pytest.mark.usefixtures("fast_compile_one_test")
def test_train_hybrid_data_and_context_parallel():
    # `make demo`'s last run: the batch over two "dp" ranks and time over two "cp" ranks
    # (zigzag) trains with the losses of one device (two steps compiled, fast: the losses
    # are checked against each other).
    import dataclasses

    module = _load("train_hybrid")
    cfg = dataclasses.replace(module.Config(), steps=3, layout="zigzag")
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        one = module.train(cfg, 1)
        sharded = module.train(cfg, 2, dp=2)
    np.testing.assert_allclose(sharded, one, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_multihost_two_processes_train_as_one(layout, tmp_path):
    # docs/examples/multihost.md: the script as two hosts (two processes of two CPU devices,
    # gloo on loopback: dp = 2 across them, cp = 2 inside each) and as one process of four
    # devices on the same mesh shape; two training steps on the same packed rows, each host
    # loading only its block, give the same losses and parameters. All three compile with
    # tests/_fast_compile.py's settings (the step in 11 s, not 40, on a loaded machine).
    script = str(EXAMPLES / "multihost.py")
    port = _processes.free_port()
    common = [sys.executable, script, "--steps", "2", "--layout", layout, "--cp", "2"]
    hosts = [
        [*common, "--local-devices", "2", "--coordinator", f"127.0.0.1:{port}"]
        + ["--num-processes", "2", "--process-id", str(i), "--save", str(tmp_path / "two.npz")]
        for i in range(2)
    ]
    alone = [*common, "--local-devices", "4", "--save", str(tmp_path / "one.npz")]
    fast = {
        "JAX_DISABLE_MOST_OPTIMIZATIONS": "1",
        "XLA_FLAGS": " ".join(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE_OPTIONS.items()),
    }
    logs = _processes.run_together([*hosts, alone], env=fast)
    assert "2 process(es) x 2 devices: mesh dp=2 x cp=2" in logs[0], logs[0][-3000:]
    assert "1 process(es) x 4 devices: mesh dp=2 x cp=2" in logs[2], logs[2][-3000:]
    assert not re.search(r"step \d", logs[1])  # only process 0 prints
    two, one = np.load(tmp_path / "two.npz"), np.load(tmp_path / "one.npz")
    assert two.files == one.files and len(one.files) > 2
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-5)
    for name in one.files:
        x, y = one[name], two[name]
        assert x.shape == y.shape, name
        assert float(np.max(np.abs(x - y))) <= 1e-5 * float(np.max(np.abs(x))), name


@pytest.mark.slow  # two configurations compiled: 93 s measured on two shared, busy cores
@pytest.mark.usefixtures("fast_compile_one_test")
def test_sft_packed():
    # docs/examples/sft_packed.md: supervised fine-tuning on packed rows gives the same
    # losses on one device as at dp = 2 x cp = 2 in zigzag with the experts split over the
    # context axis (three steps compiled; the losses are checked against each other), and
    # they fall.
    configs = ("1 device", "dp2 x cp2 zigzag, experts over cp")
    results = _load("sft_packed").main(configs=configs, steps=3, verbose=False)
    one, sharded = (np.asarray(results[c]) for c in configs)
    np.testing.assert_allclose(sharded, one, rtol=1e-5)
    assert one[-1] < one[0], one

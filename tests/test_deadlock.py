"""No recurrence hangs: `jax.grad` of every recurrence on one CPU device, and every
context-parallel kernel on exactly four.

The shapes are those at which a path through LAPACK's triangular solve once deadlocked
(B=1, T=1024, H=4, HV=8, K=V=64 on one device; T=1024, H=2, HV=4, K=V=32 on four); the
suite's usual shapes and its 8 devices would not show it. Each check runs in a fresh process
(the device count is fixed at start-up), watched by `tests/_stall.py`: a process whose CPU
time stops advancing for `STALL_S` seconds is hung, one that is merely slow (on a loaded
machine) is left to finish. The processes load their programs from the suite's persistent
compilation cache where it has them (the hang was in running a program, not in compiling it).
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from . import _stall
from ._compile_cache import ROOT


STALL_S = 60  # seconds without CPU time: every thread is blocked

_PRELUDE = """
import sys
import jax
from tests import _compile_cache

_compile_cache.enable()  # the suite's persistent cache: the repeated runs load the programs
import jax.numpy as jnp
import numpy as np
import deltanet_cp as dcp

def inputs(family, seed, t, h, hv, k, v):
    rng = np.random.default_rng(seed)
    def normal(*shape, s=1.0):
        return jnp.asarray(s * rng.normal(size=shape), jnp.float32)
    def gate(*shape):
        return jnp.asarray(-np.exp(rng.uniform(-5.0, 0.0, size=shape)), jnp.float32)
    def unit(*shape):
        return jnp.asarray(rng.uniform(size=shape), jnp.float32)
    q, kk, vv = normal(1, t, h, k), normal(1, t, h, k), normal(1, t, hv, v)
    if family == "gated_delta_rule":
        return q, kk, vv, gate(1, t, hv), unit(1, t, hv)
    if family == "delta_rule":
        return q, kk, vv, unit(1, t, hv)
    if family == "kda":
        return q, kk, vv, gate(1, t, hv, k), unit(1, t, hv)
    if family == "gla":
        return q, normal(1, t, h, k, s=k**-0.5), vv, gate(1, t, hv, k)
    if family == "gated_delta_product":
        return q, normal(1, t, 2, h, k), normal(1, t, 2, hv, v), gate(1, t, hv), unit(1, t, 2, hv)
    raise ValueError(family)

FAMILIES = ["gated_delta_rule", "delta_rule", "kda", "gla",
            "gated_delta_product"]
REPEATS = int(sys.argv[1])
"""

# jax.grad of every recurrence at the one-device shape.
_ONE_DEVICE = """
assert len(jax.devices()) == 1, jax.devices()
for family in FAMILIES:
    chunk = getattr(dcp, f"chunk_{family}")
    args = inputs(family, 0, t=1024, h=4, hv=8, k=64, v=64)
    l2 = family != "gla"

    def loss(*args):
        o, h = chunk(*args, use_qk_l2norm=l2)
        return jnp.sum(o) + jnp.sum(h)

    grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))
    for i in range(REPEATS):
        jax.block_until_ready(grad(*args))
        print(f"{family} grad run {i} done", flush=True)
"""

# Every recurrence's context-parallel kernel on exactly 4 devices, with and without packed
# documents (one crossing every rank boundary).
_FOUR_DEVICES = """
from jax.sharding import NamedSharding, PartitionSpec as P

assert len(jax.devices()) == 4, jax.devices()
mesh = jax.make_mesh((4,), ("cp",))
seq = P(None, "cp")
cu = jnp.asarray([0, 100, 700, 1024], jnp.int32)
for family in FAMILIES:
    chunk = getattr(dcp, f"chunk_{family}")
    args = inputs(family, 1, t=1024, h=2, hv=4, k=32, v=32)
    l2 = family != "gla"
    for packed in [False, True]:
        def per_rank(cu, args):
            return chunk(*args, cu_seqlens=cu if packed else None, use_qk_l2norm=l2,
                         cp=dcp.ContextParallel("cp"))

        fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), (seq,) * len(args)),
                                   out_specs=(seq, P())))
        placed = jax.device_put(args, NamedSharding(mesh, seq))
        for i in range(REPEATS):
            jax.block_until_ready(fn(cu, placed))
            print(f"{family} cp4 packed={packed} run {i} done", flush=True)
"""


def _env(devices: int) -> dict[str, str]:
    # The suite's conftest sets 8 host devices; these processes choose their own count.
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if devices > 1:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}


def _start(script: str, devices: int, repeats: int, log) -> subprocess.Popen:
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(repeats)],
        env=_env(devices),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _finish(proc: subprocess.Popen, log, what: str) -> None:
    try:
        code = _stall.wait(proc, stall_s=STALL_S)
    except _stall.Stalled as e:
        log.seek(0)
        last = log.read().decode(errors="replace").strip().splitlines()[-1:] or ["(nothing)"]
        pytest.fail(f"{what} hung: {e}. Last line of output: {last[0]}")
    log.seek(0)
    out = log.read().decode(errors="replace")
    assert code == 0, f"{what} failed:\n{out[-4000:]}"


def _run_both(repeats: int) -> None:
    # The two processes run side by side: the test waits for the slower one only.
    with tempfile.TemporaryFile() as log_one, tempfile.TemporaryFile() as log_four:
        one = _start(_ONE_DEVICE, 1, repeats, log_one)
        four = _start(_FOUR_DEVICES, 4, repeats, log_four)
        try:
            _finish(one, log_one, "jax.grad of every recurrence on one CPU device")
            _finish(four, log_four, "every context-parallel kernel on 4 CPU devices")
        finally:
            for proc in (one, four):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


# Slow only: about 45 s of both cores, running (not compiling) programs at the shapes of the
# hang, ten times each in fresh processes: a hang of this kind is a race, seen in some runs
# only.
@pytest.mark.slow
def test_recurrences_do_not_hang_repeatedly():
    _run_both(repeats=10)


# A bad traced `cu_seqlens` on 4 devices: every rank must raise (a rank that raised alone
# would leave the others waiting in the exchange's collectives). With a mesh, under
# `jax.jit`; and inside a user's `shard_map` with `cu_seqlens` bad on one rank only.
_BAD_CU_SEQLENS = """
from jax.sharding import NamedSharding, PartitionSpec as P

assert len(jax.devices()) == 4, jax.devices()
mesh = jax.make_mesh((4,), ("cp",))
args = inputs("gated_delta_rule", 2, t=16, h=1, hv=2, k=4, v=3)
good = jnp.asarray([0, 6, 16], jnp.int32)

cp = dcp.ContextParallel("cp", mesh=mesh)
fn = jax.jit(lambda cu: dcp.chunk_gated_delta_rule(*args, cu_seqlens=cu, chunk_size=4, cp=cp))
jax.block_until_ready(fn(good))
print("mesh: good ran", flush=True)
try:
    jax.block_until_ready(fn(jnp.asarray([0, 6, 15], jnp.int32)))
    raise SystemExit("mesh: no error")
except Exception as e:
    assert "cu_seqlens" in str(e), str(e)[-2000:]
print("mesh: raised", flush=True)

seq = P(None, "cp")
def per_rank(cu, args):
    return dcp.chunk_gated_delta_rule(*args, cu_seqlens=cu, chunk_size=4,
                                      cp=dcp.ContextParallel("cp"))

inner = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P("cp"), (seq,) * len(args)),
                              out_specs=(seq, P())))
placed = jax.device_put(args, NamedSharding(mesh, seq))
per_rank_cu = np.tile(np.asarray(good), 4)
ranks = NamedSharding(mesh, P("cp"))
jax.block_until_ready(inner(jax.device_put(per_rank_cu, ranks), placed))
print("shard_map: good ran", flush=True)
try:
    per_rank_cu[2 * 3 + 2] = 15  # rank 2's copy only
    jax.block_until_ready(inner(jax.device_put(per_rank_cu, ranks), placed))
    raise SystemExit("shard_map: no error")
except Exception as e:
    assert "cu_seqlens" in str(e), str(e)[-2000:]
print("shard_map: raised", flush=True)
"""


def test_bad_cu_seqlens_raises_on_every_rank():
    with tempfile.TemporaryFile() as log:
        proc = _start(_BAD_CU_SEQLENS, 4, 1, log)
        try:
            _finish(proc, log, "a bad traced cu_seqlens on 4 devices")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        out = log.read().decode(errors="replace")
    assert "mesh: raised" in out and "shard_map: raised" in out, out[-4000:]


# The watchdog itself.

_needs_proc = pytest.mark.skipif(not _stall.can_measure(), reason="needs Linux's /proc")


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)])


@_needs_proc
def test_watchdog_detects_a_sleeping_child():
    proc = _python("import time; time.sleep(600)")
    with pytest.raises(_stall.Stalled, match="no CPU time"):
        _stall.wait(proc, stall_s=2.0, wall_cap_s=60.0)
    assert proc.poll() is not None


@_needs_proc
def test_watchdog_detects_a_sleeping_grandchild():
    # The parent waits (no CPU time) on a child that sleeps too: the whole tree is idle.
    proc = _python(
        """
        import subprocess, sys
        subprocess.run([sys.executable, "-c", "import time; time.sleep(600)"])
        """
    )
    with pytest.raises(_stall.Stalled):
        _stall.wait(proc, stall_s=3.0, wall_cap_s=60.0)


@_needs_proc
def test_watchdog_lets_a_slow_child_finish():
    # Mostly asleep, but using a little CPU time every 0.3 s: slow, not hung.
    proc = _python(
        """
        import time
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            t = time.process_time()
            while time.process_time() < t + 0.03:
                pass
            time.sleep(0.3)
        """
    )
    assert _stall.wait(proc, stall_s=2.0, wall_cap_s=60.0) == 0


@_needs_proc
def test_cpu_seconds_counts_busy_children():
    proc = _python(
        r"""
        import subprocess, sys
        spin = "import time; t = time.monotonic()\nwhile time.monotonic() < t + 60: pass"
        subprocess.run([sys.executable, "-c", spin])
        """
    )
    try:
        before = _stall.cpu_seconds(proc.pid)
        deadline = time.monotonic() + 30
        while _stall.cpu_seconds(proc.pid) < before + 0.5:
            assert time.monotonic() < deadline, "the busy grandchild's CPU time was not counted"
            time.sleep(0.2)
    finally:
        for child in _stall._descendants(proc.pid):
            os.kill(child, 9)
        proc.kill()
        proc.wait()


@_needs_proc
def test_run_captures_output_without_a_time_limit():
    result = _stall.run(
        [sys.executable, "-c", "import sys; print('out' * 30000); print('err', file=sys.stderr)"]
    )
    assert result.returncode == 0
    assert result.stdout.strip() == "out" * 30000  # more than a pipe holds
    assert result.stderr.strip() == "err"
    with pytest.raises(_stall.Stalled, match="no CPU time"):
        _stall.run([sys.executable, "-c", "import time; time.sleep(600)"], stall_s=2.0)


@_needs_proc
def test_wait_all_counts_the_processes_together():
    # One waits (as a rank in a collective) while the other computes: progress, no stall.
    spin = "import time\nt = time.monotonic()\nwhile time.monotonic() < t + 4: pass"
    waiting = _python("import time; time.sleep(5)")
    busy = subprocess.Popen([sys.executable, "-c", spin])
    assert _stall.wait_all([waiting, busy], stall_s=2.0) == [0, 0]
    # Both asleep: stalled, and both are killed.
    procs = [_python("import time; time.sleep(600)") for _ in range(2)]
    with pytest.raises(_stall.Stalled):
        _stall.wait_all(procs, stall_s=2.0)
    assert all(p.poll() is not None for p in procs)

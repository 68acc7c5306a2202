"""No recurrence hangs: issue 11's deadlock, on one CPU device and on four.

The old DeltaNet / KDA / DeltaProduct path called LAPACK's triangular solve; at
B=1, T=1024, H=4, HV=8, K=V=64 `jax.grad` of KDA hung on its first call on one CPU device,
and KDA's context-parallel kernel on exactly 4 CPU devices (T=1024, H=2, HV=4, K=V=32) hung
in 2 of 2 runs. The suite's usual shapes and its 8 devices hid it. Each check runs in a
fresh process (the device count is fixed at start-up) with a timeout; a timeout is a hang.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest


TIMEOUT = 240  # seconds; a normal run takes a fraction of this

_PRELUDE = """
import sys
import jax
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
    if family == "kimi_delta_attention":
        return q, kk, vv, gate(1, t, hv, k), unit(1, t, hv)
    if family == "gla":
        return q, normal(1, t, h, k, s=k**-0.5), vv, gate(1, t, hv, k)
    if family == "gated_delta_product":
        return q, normal(1, t, 2, h, k), normal(1, t, 2, hv, v), gate(1, t, hv), unit(1, t, 2, hv)
    raise ValueError(family)

FAMILIES = ["gated_delta_rule", "delta_rule", "kimi_delta_attention", "gla",
            "gated_delta_product"]
REPEATS = int(sys.argv[1])
FULL = sys.argv[2] == "full"
"""

# jax.grad of every recurrence at issue 11's shape, on one device. The quick run takes the
# three that used the triangular solve (DeltaNet, KDA, DeltaProduct; between them every
# gate kind of the delta-rule path they now share with the gated delta rule).
_ONE_DEVICE = """
QUICK = ["delta_rule", "kimi_delta_attention", "gated_delta_product"]
assert len(jax.devices()) == 1, jax.devices()
for family in FAMILIES if FULL else QUICK:
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
# documents (one crossing every rank boundary): in the quick run each family one way, in the
# full run every family both ways.
_FOUR_DEVICES = """
from jax.sharding import NamedSharding, PartitionSpec as P

assert len(jax.devices()) == 4, jax.devices()
mesh = jax.make_mesh((4,), ("cp",))
seq = P(None, "cp")
cu = jnp.asarray([0, 100, 700, 1024], jnp.int32)
QUICK = [("gated_delta_rule", False), ("delta_rule", True), ("kimi_delta_attention", True),
         ("gla", False), ("gated_delta_product", True)]
for family in FAMILIES:
    chunk = getattr(dcp, f"chunk_{family}")
    args = inputs(family, 1, t=1024, h=2, hv=4, k=32, v=32)
    l2 = family != "gla"
    for packed in [p for p in [False, True] if FULL or (family, p) in QUICK]:
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


def _start(script: str, devices: int, repeats: int, full: bool) -> subprocess.Popen:
    code = textwrap.dedent(_PRELUDE) + textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", code, str(repeats), "full" if full else "quick"],
        env=_env(devices),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, what: str, deadline: float) -> None:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        last = out.strip().splitlines()[-1:] or ["(nothing)"]
        pytest.fail(
            f"{what} hung: no exit after {TIMEOUT} s (a deadlock, as in issue 11). "
            f"Last progress line: {last[0]}"
        )
    assert proc.returncode == 0, f"{what} failed:\n{out[-4000:]}"


def _run_both(repeats: int, full: bool) -> None:
    # The two processes run side by side: the test waits for the slower one only.
    deadline = time.monotonic() + TIMEOUT
    one = _start(_ONE_DEVICE, 1, repeats, full)
    four = _start(_FOUR_DEVICES, 4, repeats, full)
    try:
        _finish(one, "jax.grad of every recurrence on one CPU device", deadline)
        _finish(four, "every context-parallel kernel on 4 CPU devices", deadline)
    finally:
        for proc in (one, four):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_no_deadlock():
    _run_both(repeats=3, full=False)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_no_deadlock_repeatedly(attempt):
    # Fresh processes each time: the hang was a race, seen in some runs and not others.
    _run_both(repeats=10, full=True)


# A bad traced `cu_seqlens` on 4 devices: every rank must raise (issue: one raised and the
# others waited in the exchange's collectives). With a mesh, under `jax.jit`; and inside a
# user's `shard_map` with `cu_seqlens` bad on one rank only (each rank its own copy).
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


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_bad_cu_seqlens_raises_on_every_rank():
    # A stall is no CPU time used over a while of waiting (a deadlock sleeps), not a wall
    # clock deadline, which a loaded machine would trip.
    proc = _start(_BAD_CU_SEQLENS, 4, 1, False)
    window, used = 30.0, _cpu_seconds(proc.pid)
    try:
        while True:
            try:
                out, _ = proc.communicate(timeout=window)
                break
            except subprocess.TimeoutExpired:
                now = _cpu_seconds(proc.pid)
                if now - used < 0.1:
                    proc.kill()
                    out, _ = proc.communicate()
                    pytest.fail(f"stalled (no CPU time for {window} s):\n{out[-3000:]}")
                used = now
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out[-4000:]
    assert "mesh: raised" in out and "shard_map: raised" in out, out[-4000:]

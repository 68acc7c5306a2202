"""Several JAX processes on this machine, as on several hosts: gloo over loopback.

The launching side (a test): `free_port` for the coordinator, `run_together` starts the
processes at once on simulated CPU devices and waits for them together (`tests/_stall.py`:
a rank waiting in a collective for another is progress, a stall is not). The started side
(a worker module run with `python -m tests._X_worker PORT NUM_PROCESSES PROCESS_ID ...`):
`join` initialises `jax.distributed` from those three arguments. `examples/multihost.py`
does its own start-up, as a user's script would, and is started by `run_together` too.

Nothing here imports jax at import time: a worker's devices are set (`XLA_FLAGS`, by
`run_together`) before jax starts.
"""

import os
import pathlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence

from . import _stall


ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a coordinator."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(
    commands: Sequence[Sequence[str]],
    *,
    devices: int | None = None,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """Run each command in its own process, all at once from the repository's root, on the
    CPU, and return their outputs (stdout and stderr together) once every one exits 0.

    **Arguments:**

    - `commands`: the argument lists, each starting with the program (`sys.executable`).
    - `devices`: simulated CPU devices per process (`XLA_FLAGS`); `None` leaves the flag
        to the processes (the test's own `XLA_FLAGS` is never passed on).
    - `env`: more environment variables for every process (an `XLA_FLAGS` here comes before
        the device count's).

    **Raises:** `AssertionError` with the end of the log of a process that failed;
    `_stall.Stalled` if they all stop using CPU time (every one is killed).
    """
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ |= {"JAX_PLATFORMS": "cpu", **(env or {})}
    if devices is not None:
        flags = [environ.get("XLA_FLAGS", ""), f"--xla_force_host_platform_device_count={devices}"]
        environ["XLA_FLAGS"] = " ".join(flags).strip()
    # The outputs go to files: a pipe nobody reads while waiting would fill and block.
    with tempfile.TemporaryDirectory() as folder:
        logs = [pathlib.Path(folder) / f"{i}.log" for i in range(len(commands))]
        procs = []
        try:
            for command, log in zip(commands, logs):
                with open(log, "w") as out:
                    procs.append(
                        subprocess.Popen(
                            list(command),
                            cwd=ROOT,
                            env=environ,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                        )
                    )
            codes = _stall.wait_all(procs)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        texts = [log.read_text(errors="replace") for log in logs]
    for i, (code, text) in enumerate(zip(codes, texts)):
        assert code == 0, f"process {i} exited with {code}:\n{text[-3000:]}"
    return texts


def run_workers(module: str, num_processes: int, *args: str, devices: int = 2) -> list[str]:
    """Run `python -m tests.<module> PORT NUM_PROCESSES PROCESS_ID *args` once per process
    (`devices` CPU devices each), as `run_together`."""
    port = free_port()
    commands = [
        [sys.executable, "-m", f"tests.{module}", str(port), str(num_processes), str(i), *args]
        for i in range(num_processes)
    ]
    return run_together(commands, devices=devices)


def join(argv: Sequence[str] | None = None) -> list[str]:
    """In a worker: join the others (gloo collectives, `jax.distributed.initialize` from
    `PORT NUM_PROCESSES PROCESS_ID`, the first three arguments); the remaining arguments."""
    import jax

    argv = sys.argv[1:] if argv is None else list(argv)
    port, num_processes, process_id, *rest = argv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=int(num_processes),
        process_id=int(process_id),
        initialization_timeout=60,
    )
    return rest

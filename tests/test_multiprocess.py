"""Context parallelism across processes: 2 processes x 2 CPU devices over gloo on loopback."""

import os
import pathlib
import socket
import subprocess
import sys

from . import _stall


WORKER = pathlib.Path(__file__).parent / "_multiprocess_worker.py"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_cp4_matches_single_device(tmp_path):
    port, nproc = _free_port(), 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    outs = [tmp_path / f"out{i}.txt" for i in range(nproc)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(nproc), str(i), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    try:
        _stall.wait_all(procs)  # the ranks together: one waits in a collective for the other
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [p.communicate()[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    for out in outs:
        cp, nprocs, err_o, err_h = out.read_text().split()
        assert (int(cp), int(nprocs)) == (4, 2)
        assert float(err_o) <= 1e-5
        assert float(err_h) <= 1e-5

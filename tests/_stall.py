"""A watchdog for subprocesses that tells a hung process from a slow one.

A process is *stalled* when the CPU time (user + system) of it and its descendants has not
advanced for `stall_s` seconds: every thread is blocked, waiting on something that will not
come. A slow process, on a machine it shares with other work, still gets some CPU time and is
left to finish, however long it takes. An absolute wall-clock cap is optional, as a backstop
only (a process that spins while waiting would keep its CPU time moving).

Every test that starts a subprocess waits for it here (`run`, `wait`, `wait_all`), never with
a wall-clock timeout: on a loaded machine a process that is computing is not hung.

The CPU times are read from Linux's `/proc`; without it only the wall-clock cap, if any,
applies.
"""

import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


# Seconds without any CPU time after which a test's subprocess is taken to be hung. Loading
# jax and compiling use CPU time throughout; only a blocked process stays flat this long.
STALL_S = 60.0


_PROC = Path("/proc")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def can_measure() -> bool:
    """Whether CPU times can be read (Linux's `/proc`)."""
    return (_PROC / str(os.getpid()) / "stat").exists()


def _stat(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name, or `None` if it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by `pid`, all its threads and its descendants.

    The counts of a process cover all its threads; those of its reaped children are added
    (`cutime`, `cstime`), and each live descendant's own.
    """
    ticks = 0
    for p in [pid, *_descendants(pid)]:
        fields = _stat(p)
        if fields is None:
            continue
        # utime, stime, cutime, cstime: the 14th to 17th fields of the file.
        ticks += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return ticks / _TICK


class Stalled(Exception):
    """The process stopped using CPU time (or outlived the wall-clock cap); it was killed."""


def wait(
    proc: subprocess.Popen,
    *,
    stall_s: float = STALL_S,
    wall_cap_s: float | None = None,
    poll_s: float = 0.5,
) -> int:
    """Wait for `proc` to exit and return its exit code, killing it if it stalls.

    **Arguments:**

    - `proc`: the running process.
    - `stall_s`: seconds without any CPU time used by `proc` (and its descendants) after which
        it is taken to be hung.
    - `wall_cap_s`: seconds after which it is killed however busy it is (a backstop); `None`
        for none.
    - `poll_s`: seconds between readings.

    **Returns:** the exit code. Raises `Stalled` (after killing `proc`) otherwise.
    """
    return wait_all([proc], stall_s=stall_s, wall_cap_s=wall_cap_s, poll_s=poll_s)[0]


def wait_all(
    procs: Sequence[subprocess.Popen],
    *,
    stall_s: float = STALL_S,
    wall_cap_s: float | None = None,
    poll_s: float = 0.5,
) -> list[int]:
    """Wait for processes that work together (e.g. the ranks of one `jax.distributed` job).

    They are stalled when their CPU time *together* stops advancing: one of them waiting in a
    collective while another computes is progress. On a stall (or past the cap) every one
    still running is killed and `Stalled` is raised; otherwise their exit codes are returned.
    """
    start = last_change = time.monotonic()
    measure = can_measure()
    last = {p.pid: cpu_seconds(p.pid) if measure else 0.0 for p in procs}
    while any(p.poll() is None for p in procs):
        time.sleep(poll_s)
        now = time.monotonic()
        if measure:
            running = [p for p in procs if p.pid in last and p.poll() is None]
            cpu = {p.pid: cpu_seconds(p.pid) for p in running}
            # Progress: one of them used CPU time, or one of them exited.
            if len(cpu) < len(last) or any(cpu[pid] > last[pid] for pid in cpu):
                last, last_change = cpu, now
            elif now - last_change > stall_s:
                _kill_all(procs)
                raise Stalled(
                    f"no CPU time used for {now - last_change:.0f} s "
                    f"(after {sum(cpu.values()):.1f} CPU s in {now - start:.0f} s)"
                )
        if wall_cap_s is not None and now - start > wall_cap_s:
            _kill_all(procs)
            raise Stalled(f"still running after the {wall_cap_s:.0f} s wall-clock cap")
    return [p.wait() for p in procs]


def _kill_all(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def run(
    args: Sequence[str],
    *,
    input: str | None = None,
    stall_s: float = STALL_S,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """`subprocess.run(args, capture_output=True, text=True)` watched for stalls, not timed.

    The output goes to temporary files (a pipe that nobody reads would fill and block the
    process, which would then look hung). Raises `Stalled` if the process stops using CPU time
    for `stall_s` seconds.
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=out,
            stderr=err,
            **popen_kwargs,
        )
        if input is not None:
            assert proc.stdin is not None
            proc.stdin.write(input.encode())
            proc.stdin.close()
        code = wait(proc, stall_s=stall_s)
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    return subprocess.CompletedProcess(args, code, stdout, stderr)

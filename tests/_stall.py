"""A watchdog for subprocesses that tells a hung process from a slow one.

A process is *stalled* when the CPU time (user + system) of it and its descendants has not
advanced for `stall_s` seconds: every thread is blocked, waiting on something that will not
come. A slow process, on a machine it shares with other work, still gets some CPU time and is
left to finish. An absolute wall-clock cap stays as a backstop only (a process that spins
while waiting would keep its CPU time moving).

The CPU times are read from Linux's `/proc`; without it only the wall-clock cap applies.
"""

import os
import subprocess
import time
from pathlib import Path


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


def wait(proc: subprocess.Popen, *, stall_s: float, wall_cap_s: float, poll_s: float = 0.5) -> int:
    """Wait for `proc` to exit and return its exit code, killing it if it stalls.

    **Arguments:**

    - `proc`: the running process.
    - `stall_s`: seconds without any CPU time used by `proc` (and its descendants) after which
        it is taken to be hung.
    - `wall_cap_s`: seconds after which it is killed however busy it is (a backstop).
    - `poll_s`: seconds between readings.

    **Returns:** the exit code. Raises `Stalled` (after killing `proc`) otherwise.
    """
    start = last_change = time.monotonic()
    measure = can_measure()
    last_cpu = cpu_seconds(proc.pid) if measure else 0.0
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if measure:
            cpu = cpu_seconds(proc.pid)
            if cpu > last_cpu:
                last_cpu, last_change = cpu, now
            elif now - last_change > stall_s:
                _kill(proc)
                raise Stalled(
                    f"no CPU time used for {now - last_change:.0f} s "
                    f"(after {last_cpu:.1f} CPU s in {now - start:.0f} s)"
                )
        if now - start > wall_cap_s:
            _kill(proc)
            raise Stalled(f"still running after the {wall_cap_s:.0f} s wall-clock cap")


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()

"""One implementation per process, paired: the harness every peer comparison runs through.

Timing two implementations side by side in one process measures their interaction as much
as themselves: LAPACK's and PyTorch's thread pools keep spinning after a call and slow
whatever runs next in the same process. So:

- **One process per implementation.** Each runs in its own worker process, built by a
  factory function (`module:function` in `benchmarks/`) that compiles it and returns
  zero-argument calls, one per pass (`Prepared`).
- **Nothing else runs while one is timed.** The workers not being timed are stopped
  (`SIGSTOP` to their process group), so not even a pool spinning after its last call
  takes a core from the one being timed.
- **Alternated and paired.** A round times every implementation once, each pass `calls`
  times (the round keeps the median); the order rotates from round to round (A B C, B C
  A, C A B, ...). A ratio between two implementations is the median over rounds of the
  per-round ratio: both saw the same machine in that round, so most of the drift of a
  shared machine cancels.
- **Hangs are results.** A worker whose CPU time stops advancing for `hang_after` seconds
  while it should be working (jaxlib's CPU triangular solve can deadlock), or that runs
  past `timeout` seconds on one command, is killed and reported as `hang` / `timeout`;
  with `retries` it is restarted for the rounds left. Past the session's `deadline`
  nothing new starts and what was not run is reported as `budget`.

A factory is called in the worker as `factory(**impl.kwargs, **case_kwargs)` and returns a
`Prepared`. The driver side is `Session`:

    with Session([Impl("ours", "_impls:ours"), Impl("MaxText", "_impls:maxtext")]) as s:
        s.prepare(b=1, t=2048, h=16, hv=32, d=128, passes=["fwd", "fwd+bwd"])
        result = s.time(["fwd", "fwd+bwd"], rounds=5)
    result.ratio("MaxText", "ours", "fwd")   # median of per-round MaxText / ours times
"""

import dataclasses
import importlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "@@ "  # worker lines meant for the driver; anything else a worker prints is ignored


# ------------------------------------------------------------------ both sides


@dataclasses.dataclass
class Prepared:
    """What a factory returns, in the worker.

    - `calls`: pass name -> a zero-argument call that blocks until its result is ready.
    - `outputs`: returns named float32 numpy arrays to compare between implementations.
    - `info`: JSON-serialisable facts (versions, compile seconds, compiled temporaries).
    """

    calls: dict[str, Callable[[], object]]
    outputs: Callable[[], dict] | None = None
    info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation: a table label, its factory (`module:function` in `benchmarks/`),
    keyword arguments for every call of it, extra environment for its worker, and the
    Python interpreter its worker runs in (`None`: the driver's, e.g. a virtualenv with
    torch for a PyTorch peer when the driver's has none)."""

    name: str
    factory: str
    kwargs: dict = dataclasses.field(default_factory=dict)
    env: dict = dataclasses.field(default_factory=dict)
    python: str | None = None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (all its threads) from /proc; None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# ------------------------------------------------------------------ worker side


def _reply(**record) -> None:
    print(MARK + json.dumps(record), flush=True)


def _error(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {first}"[:300]


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _worker(spec: dict) -> None:
    """Answer JSON commands from stdin, one line each: prepare, outputs, time, quit."""
    sys.path[:0] = [HERE]
    if ROOT not in sys.path:
        sys.path.append(ROOT)  # the checkout, if deltanet_cp is not installed
    module_name, function = spec["factory"].split(":")
    factory = None
    prepared: Prepared | None = None
    for line in sys.stdin:
        command = json.loads(line)
        op, args = command["op"], command.get("args", {})
        if op == "quit":
            break
        try:
            if op == "prepare":
                prepared = None
                import gc

                gc.collect()  # the previous case's buffers, before the new ones
                if factory is None:
                    factory = getattr(importlib.import_module(module_name), function)
                start = time.perf_counter()
                prepared = factory(**spec["kwargs"], **args)
                build_s = time.perf_counter() - start
                first = {}
                for name, call in prepared.calls.items():
                    first[name] = _timed(call)  # an eager framework compiles here
                    call()  # and once more, so the rounds start warm
                _reply(info=prepared.info, build_s=build_s, first_call_s=first, pid=os.getpid())
            elif op == "outputs":
                import numpy as np

                arrays = prepared.outputs() if prepared and prepared.outputs else {}
                np.savez(args["path"], **arrays)
                _reply(saved=sorted(arrays))
            elif op == "time":
                times, errors = {}, {}
                for name in args["passes"]:
                    if name not in prepared.calls:
                        continue
                    try:
                        times[name] = [_timed(prepared.calls[name]) for _ in range(args["calls"])]
                    except Exception as e:  # an out-of-memory is a result, not a crash
                        errors[name] = _error(e)
                _reply(times=times, errors=errors, load=os.getloadavg()[0])
            else:
                _reply(error=f"unknown command {op!r}")
        except Exception as e:
            traceback.print_exc()
            _reply(error=_error(e))


# ------------------------------------------------------------------ driver side


class Gone(Exception):
    """A worker died, hung, ran past its timeout or past the deadline; `why` says which."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class Worker:
    """One implementation's process, answering one command at a time."""

    def __init__(self, impl: Impl, extra_env: dict | None = None):
        env = dict(os.environ)
        env.update(extra_env or {})
        env.update(impl.env)
        spec = {"factory": impl.factory, "kwargs": impl.kwargs}
        python = impl.python or sys.executable
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", json.dumps(spec)],
            cwd=HERE,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: stop, continue and kill it whole
        )
        self.records: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.paused = False

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.records.put(json.loads(line[len(MARK) :]))
        self.records.put(None)

    def _read_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)
            del self.stderr[:-40]

    def _signal(self, sig):
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self):
        """Stop every thread of the worker until `resume` (so it takes no core meanwhile)."""
        self._signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self._signal(signal.SIGCONT)
        self.paused = False

    def ask(self, op: str, *, timeout: float, hang_after: float, deadline: float, **args):
        """Send one command and wait for its reply.

        Raises `Gone` if the worker exits, its CPU time stops advancing for `hang_after`
        seconds (0: never checked), the command runs past `timeout` seconds, or the
        `deadline` (monotonic) passes.
        """
        if self.paused:
            self.resume()
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        start = progress = time.monotonic()
        last_cpu = cpu_seconds(self.proc.pid) or 0.0
        while True:
            try:
                record = self.records.get(timeout=0.25)
            except queue.Empty:
                now = time.monotonic()
                cpu = cpu_seconds(self.proc.pid)
                if cpu is not None and cpu > last_cpu + 0.01:
                    last_cpu, progress = cpu, now
                why = None
                if hang_after and now - progress > hang_after:
                    why = "hang"
                elif now - start > timeout:
                    why = "timeout"
                elif now > deadline:
                    why = "budget"
                if why:
                    self.kill()
                    raise Gone(why) from None
                continue
            if record is None:
                self.proc.wait()
                tail = " ".join("".join(self.stderr[-4:]).split())[-300:]
                raise Gone(f"exited ({self.proc.returncode}): {tail}")
            return record

    def kill(self):
        if self.proc.poll() is None:
            self._signal(signal.SIGCONT)
            self._signal(signal.SIGKILL)
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.resume()
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except Exception:
                pass
        self.kill()


@dataclasses.dataclass
class Outcome:
    """One implementation in one case.

    - `rounds`: per round, pass -> the round's median seconds (missing: not timed then).
    - `status`: "ok", or why it stopped: "hang", "timeout", "budget", "exited (...)",
      "error: ..." (the factory raised).
    - `events`: where each hang, timeout or failure happened.
    """

    info: dict = dataclasses.field(default_factory=dict)
    first_call_s: dict = dataclasses.field(default_factory=dict)
    rounds: list = dataclasses.field(default_factory=list)
    errors: dict = dataclasses.field(default_factory=dict)
    status: str = "ok"
    events: list = dataclasses.field(default_factory=list)
    loads: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Paired:
    """Paired timings of one case: `outcomes[name]` per implementation, and the arrays
    each one's `outputs()` returned (`outputs[name]`)."""

    names: list
    outcomes: dict
    outputs: dict

    def times(self, name: str, pass_: str) -> list[float]:
        return [r[pass_] for r in self.outcomes[name].rounds if pass_ in r]

    def median(self, name: str, pass_: str) -> float | None:
        t = self.times(name, pass_)
        return statistics.median(t) if t else None

    def ratio(self, num: str, den: str, pass_: str, den_pass: str | None = None) -> float | None:
        """Median over rounds of `num`'s time / `den`'s time, in the rounds both were timed.

        With `den_pass`, the denominator is `den`'s time for that pass (e.g. one
        implementation's fwd+bwd over its own fwd: `ratio(a, a, "fwd+bwd", "fwd")`).
        """
        den_pass = den_pass or pass_
        a, b = self.outcomes[num].rounds, self.outcomes[den].rounds
        pairs = [(x[pass_], y[den_pass]) for x, y in zip(a, b) if pass_ in x and den_pass in y]
        return statistics.median(p / q for p, q in pairs) if pairs else None

    def rounds(self, name: str, pass_: str) -> int:
        return len(self.times(name, pass_))

    def why_missing(self, name: str, pass_: str) -> str:
        """A table cell for a time that is not there: "hang", "timeout", "budget", ..."""
        out = self.outcomes[name]
        if pass_ in out.errors:
            return out.errors[pass_].split(":")[0]
        if out.status != "ok":
            return out.status.split(":")[0].split(" (")[0]
        return "-"

    def ms(self, name: str, pass_: str) -> str:
        """The median in milliseconds, marked `*` if the implementation hung or failed in
        some round (the note under the table says where), or why there is none."""
        m = self.median(name, pass_)
        if m is None:
            return self.why_missing(name, pass_)
        mark = "*" if self.outcomes[name].events else ""
        return f"{m * 1e3:.1f}{mark}" if m < 1 else f"{m * 1e3:.0f}{mark}"

    def notes(self) -> list[str]:
        return [f"{n}: {e}" for n in self.names for e in self.outcomes[n].events]


class Session:
    """Workers for a list of implementations, one process each, kept across cases.

    **Arguments:**

    - `impls`: the implementations; the first is the one others are compared with.
    - `hang_after`: seconds without CPU progress that make a running command a hang
      (0: not checked, e.g. on a GPU, where a waiting process may use no CPU).
    - `timeout`: seconds one command (a prepare, or one implementation's turn in a round)
      may take.
    - `deadline`: `time.monotonic()` after which nothing new starts.
    - `retries`: restarts of an implementation that hung or died, per case.
    - `env`: extra environment for every worker.
    - `log`: where progress lines go.
    """

    def __init__(
        self,
        impls: list[Impl],
        *,
        hang_after: float = 30.0,
        timeout: float = 900.0,
        deadline: float = float("inf"),
        retries: int = 0,
        env: dict | None = None,
        log: Callable[[str], None] = print,
    ):
        self.impls = {i.name: i for i in impls}
        self.names = [i.name for i in impls]
        self.hang_after, self.timeout, self.deadline = hang_after, timeout, deadline
        self.retries, self.env, self.log = retries, env, log
        self.workers: dict[str, Worker] = {}
        self.case: dict = {}
        self.outcomes: dict[str, Outcome] = {}
        self.attempts: dict[str, int] = {}
        self.tmp = tempfile.mkdtemp(prefix="bench-outputs-")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        for w in self.workers.values():
            w.close()
        self.workers.clear()

    def _ask(self, name: str, op: str, timeout: float | None = None, **args) -> dict:
        worker = self.workers[name]
        try:
            return worker.ask(
                op,
                timeout=timeout or self.timeout,
                hang_after=self.hang_after,
                deadline=self.deadline,
                **args,
            )
        finally:
            if worker.proc.poll() is None:
                worker.pause()

    def _lose(self, name: str, why: str, where: str):
        out = self.outcomes[name]
        out.status = why
        out.events.append(f"{why} in {where}")
        self.log(f"  {name}: {why} in {where}")
        worker = self.workers.pop(name, None)
        if worker is not None:
            worker.kill()

    def _start(self, name: str) -> bool:
        """Start `name`'s worker if needed and prepare the current case; False if lost."""
        out = self.outcomes[name]
        if time.monotonic() > self.deadline:
            out.status = "budget"
            return False
        if name not in self.workers:
            self.workers[name] = Worker(self.impls[name], self.env)
        try:
            r = self._ask(name, "prepare", **self.case)
        except Gone as e:
            self._lose(name, e.why, "prepare")
            return False
        if "error" in r:
            self._lose(name, f"error: {r['error']}", "prepare")
            return False
        out.info, out.first_call_s = r["info"], r["first_call_s"]
        out.status = "ok"
        self.log(
            f"  {name}: ready in {r['build_s']:.1f} s (first calls: "
            + ", ".join(f"{p} {s:.2f} s" for p, s in r["first_call_s"].items())
            + ")"
        )
        return True

    def prepare(self, **case) -> None:
        """Build every implementation for one case, one worker at a time (the others
        stopped), with `factory(**impl.kwargs, **case)`; save their outputs."""
        self.case = case
        self.outcomes = {n: Outcome() for n in self.names}
        self.attempts = {n: 0 for n in self.names}
        for name in self.names:
            self._start(name)

    def time(self, passes: list[str], rounds: int, calls: int = 1) -> Paired:
        """`rounds` paired rounds of the prepared case; returns the `Paired` result."""
        outputs = {}
        for name in self.names:
            if name not in self.workers:
                continue
            path = os.path.join(self.tmp, f"{len(os.listdir(self.tmp))}.npz")
            try:
                r = self._ask(name, "outputs", path=path)
            except Gone as e:
                self._lose(name, e.why, "its first outputs")
                continue
            if "error" not in r:
                import numpy as np

                with np.load(path) as z:
                    outputs[name] = {k: z[k] for k in z.files}
                os.remove(path)
        for i in range(rounds):
            if time.monotonic() > self.deadline:
                for name in self.names:
                    if self.outcomes[name].status == "ok":
                        self.outcomes[name].status = "budget"
                self.log(f"  time budget spent after {i} rounds")
                break
            order = self.names[i % len(self.names) :] + self.names[: i % len(self.names)]
            for name in order:
                out = self.outcomes[name]
                row: dict = {}
                lost = out.status.split(" ")[0] in ("hang", "timeout", "exited")
                if name not in self.workers and lost:
                    if self.attempts[name] < self.retries:
                        self.attempts[name] += 1
                        self.log(f"  {name}: restarting (retry {self.attempts[name]})")
                        self._start(name)
                if name in self.workers:
                    todo = [p for p in passes if p not in out.errors]
                    try:
                        r = self._ask(name, "time", passes=todo, calls=calls)
                        row = {p: statistics.median(t) for p, t in r["times"].items()}
                        out.errors.update(r.get("errors", {}))
                        out.loads.append(r.get("load"))
                    except Gone as e:
                        self._lose(name, e.why, f"round {i + 1}")
                out.rounds.append(row)
        return Paired(list(self.names), self.outcomes, outputs)


def max_rel_diff(a, b) -> float:
    """`max |a - b| / max |b|` over float64 copies."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(json.loads(sys.argv[2]))
    else:
        sys.exit("benchmarks/_harness.py is started by the benchmark scripts, not by hand")

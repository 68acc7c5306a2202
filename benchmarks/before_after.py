"""Paired before/after speed of the chunked delta-rule kernels: two checkouts, one table.

Each side (a checkout of this repository) runs in worker processes, one per case, with
`PYTHONPATH` set to a copy of the checkout's `deltanet_cp/` taken at the start (edits during
the run cannot leak in), so that `import deltanet_cp` resolves to that version. A worker
compiles its case once (forward, and forward+backward: `jax.grad` of the summed outputs with
respect to every float input), then answers timing requests. The parent alternates the sides
round by round (before/after, then after/before, ...); a request times at least `--calls`
calls and `--min-time` seconds and answers their median (and fastest), and a case's ratio is
the median over rounds of the per-round `after / before` ratios, which cancels most of the
drift of a shared machine. Both sides also save their outputs for one fixed seed, and the
table reports the largest absolute difference between the two versions.

    python benchmarks/before_after.py --before /tmp/before [--after .] [--rounds 9] [--quick]

float32, chunk 64, B = 1, YNNPACK off (`--xla_cpu_experimental_ynn_fusion_type=`, as the
tests). Only one worker computes at any time. A worker whose CPU time stops advancing while
it owes an answer (`--stall` seconds) is deadlocked — the old `solve_triangular` path of
DeltaNet, KDA and DeltaProduct hangs now and then in jaxlib's LAPACK call (issue 11) — and is
replaced by a fresh one, up to `--retries` times per case, pass and side; hangs are counted
under the table.
"""

import argparse
import hashlib
import inspect
import json
import os
import pathlib
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np


HERE = pathlib.Path(__file__).resolve().parent
NO_YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
CHUNK = 64
PASSES = ("forward", "forward+backward")

# name -> (function, shape): H query/key heads, HV value heads, T tokens, D = K = V.
FULL_CASES = {
    "gdn H16 HV32 T2048": ("chunk_gated_delta_rule", dict(h=16, hv=32, t=2048, d=128)),
    "gdn H4 HV4 T4096": ("chunk_gated_delta_rule", dict(h=4, hv=4, t=4096, d=128)),
    "deltanet H4 T2048": ("chunk_delta_rule", dict(h=4, hv=4, t=2048, d=128)),
    "kda H4 T2048": ("chunk_kimi_delta_attention", dict(h=4, hv=4, t=2048, d=128)),
    "deltaproduct nh2 H4 T2048": ("chunk_gated_delta_product", dict(h=4, hv=4, t=2048, d=128)),
}
QUICK_CASES = {
    "gdn H4 HV8 T512": ("chunk_gated_delta_rule", dict(h=4, hv=8, t=512, d=64)),
    "gdn H2 HV2 T1024": ("chunk_gated_delta_rule", dict(h=2, hv=2, t=1024, d=64)),
    "deltanet H2 T512": ("chunk_delta_rule", dict(h=2, hv=2, t=512, d=64)),
    "kda H2 T512": ("chunk_kimi_delta_attention", dict(h=2, hv=2, t=512, d=64)),
    "deltaproduct nh2 H2 T512": ("chunk_gated_delta_product", dict(h=2, hv=2, t=512, d=64)),
}
N_HOUSEHOLDER = 2


# ---------------------------------------------------------------------------------------------
# Worker side: runs under the checkout's PYTHONPATH, talks JSON lines on its own stdout.


def make_inputs(fn_name: str, h: int, hv: int, t: int, d: int, seed: int = 0) -> list:
    """float32 inputs for one case, drawn with numpy from `seed` (the same in both workers)."""
    from _common import gdn_inputs

    rng = np.random.default_rng(seed)
    b = 1
    if fn_name == "chunk_gated_delta_rule":
        return gdn_inputs(rng, b, t, h, hv, d)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def sigmoid(*shape):
        return (1 / (1 + np.exp(-rng.standard_normal(shape)))).astype(np.float32)

    if fn_name == "chunk_delta_rule":
        return [normal(b, t, h, d), normal(b, t, h, d), normal(b, t, hv, d), sigmoid(b, t, hv)]
    if fn_name == "chunk_kimi_delta_attention":
        q, k, v = normal(b, t, h, d), normal(b, t, h, d), normal(b, t, hv, d)
        g = -np.exp(rng.uniform(-5.0, 0.0, size=(b, t, hv, d))).astype(np.float32)
        return [q, k, v, g, sigmoid(b, t, hv)]
    if fn_name == "chunk_gated_delta_product":
        n = N_HOUSEHOLDER
        q, k, v = normal(b, t, h, d), normal(b, t, n, h, d), normal(b, t, n, hv, d)
        g = -np.log1p(np.exp(rng.standard_normal((b, t, hv)))).astype(np.float32)
        return [q, k, v, g, sigmoid(b, t, n, hv)]
    raise ValueError(fn_name)


def build(fn_name: str):
    """`forward(*inputs) -> (o, final_state)` and `forward_backward(*inputs) -> grads`."""
    import jax
    import jax.numpy as jnp

    import deltanet_cp as dcp

    kernel = getattr(dcp, fn_name)
    params = inspect.signature(kernel).parameters
    l2 = "use_qk_l2norm" if "use_qk_l2norm" in params else "use_qk_l2norm_in_kernel"
    options = {l2: True, "chunk_size": CHUNK, "output_final_state": True}

    def forward(*x):
        o, state = kernel(*x, **options)
        return o, state

    def loss(*x):
        o, state = forward(*x)
        return jnp.sum(o) + jnp.sum(state)

    def forward_backward(*x):
        return jax.grad(loss, argnums=tuple(range(len(x))))(*x)

    return {"forward": forward, "forward+backward": forward_backward}, l2


def worker(out_dir: str) -> None:
    """Answer `setup` and `time` requests, one JSON object per line, until stdin closes."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed to stdout goes to stderr

    def send(obj):
        proto.write(json.dumps(obj) + "\n")

    try:
        import jax

        import deltanet_cp
    except BaseException as e:  # report the import failure verbatim
        import traceback

        send({"ok": False, "error": "".join(traceback.format_exception(e))})
        return
    send(
        {
            "ok": True,
            "file": deltanet_cp.__file__,
            "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        }
    )
    compiled = {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "setup":
                case, pass_name = req["case"], req["pass"]
                fn_name, shape = req["fn"], req["shape"]
                fns, l2 = build(fn_name)
                x = [jax.numpy.asarray(a) for a in make_inputs(fn_name, **shape)]
                start = time.perf_counter()
                exe = jax.jit(fns[pass_name]).lower(*x).compile()
                compile_s = time.perf_counter() - start
                start = time.perf_counter()
                out = jax.block_until_ready(exe(*x))
                first_s = time.perf_counter() - start
                leaves = [np.asarray(a) for a in jax.tree.leaves(out)]
                path = os.path.join(out_dir, f"{req['index']}.npz")
                np.savez(path, *leaves)
                compiled[(case, pass_name)] = (exe, x)
                send(
                    {
                        "ok": True,
                        "compile_s": compile_s,
                        "first_s": first_s,
                        "outputs": path,
                        "l2_kwarg": l2,
                        "finite": bool(all(np.isfinite(a).all() for a in leaves)),
                    }
                )
            elif req["op"] == "time":
                exe, x = compiled[(req["case"], req["pass"])]
                times = []  # at least `calls` calls, more until `min_time` seconds (<= 50)
                while len(times) < req["calls"] or (
                    sum(times) < req["min_time"] and len(times) < 50
                ):
                    start = time.perf_counter()
                    jax.block_until_ready(exe(*x))
                    times.append(time.perf_counter() - start)
                send({"ok": True, "times": times})
            else:
                raise ValueError(f"unknown op {req['op']!r}")
        except Exception as e:
            import traceback

            send({"ok": False, "error": "".join(traceback.format_exception(e))})


# ---------------------------------------------------------------------------------------------
# Parent side.


class Hung(Exception):
    pass


class WorkerError(Exception):
    pass


class Side:
    """One checkout's worker process."""

    def __init__(self, name: str, checkout: str, out_dir: str, stall: float):
        self.name, self.checkout, self.out_dir, self.stall = name, checkout, out_dir, stall
        self.log = open(os.path.join(out_dir, "stderr.txt"), "ab")
        self.proc = None
        self.info = None
        self.ready: set[tuple] = set()  # items set up in the current worker process

    def start(self, timeout: float) -> None:
        self.ready = set()
        env = dict(os.environ)
        env["PYTHONPATH"] = self.checkout
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + NO_YNN_FLAG).strip()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", self.out_dir],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env=env,
            cwd=self.out_dir,  # not a checkout: only PYTHONPATH decides which deltanet_cp
        )
        self.info = self._read(timeout)

    def _read(self, timeout: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        start = time.monotonic()
        cpu, cpu_at = self.cpu_seconds() or 0.0, start
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], 2.0)
            if ready:
                break
            now = time.monotonic()
            if now - start > timeout:
                self.kill()
                raise Hung(f"no answer within {timeout:.0f} s")
            c = self.cpu_seconds()
            if c is None or c > cpu + 0.05:
                cpu, cpu_at = c or 0.0, now
            elif now - cpu_at > self.stall:
                self.kill()
                raise Hung(f"CPU time frozen at {c:.1f} s for {self.stall:.0f} s: deadlocked")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise WorkerError(f"worker exited (rc {self.proc.returncode}):\n{self.stderr_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise WorkerError(reply["error"])
        return reply

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the worker, all threads (Linux `/proc`; else None)."""
        try:
            assert self.proc is not None
            fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1]
            utime, stime = fields.split()[11:13]
            return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AssertionError):
            return None

    def request(self, timeout: float, **req) -> dict:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def stderr_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return pathlib.Path(self.out_dir, "stderr.txt").read_text(errors="replace")[-n:]

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()


def max_abs_diff(path_a: str, path_b: str) -> tuple[float, float]:
    """Largest `|a - b|` over all output leaves, and the largest `|a|` (for scale)."""
    a, b = np.load(path_a), np.load(path_b)
    diff = scale = 0.0
    for key in a.files:
        x, y = a[key].astype(np.float64), b[key].astype(np.float64)
        if x.shape != y.shape:
            return float("nan"), float("nan")
        diff = max(diff, float(np.max(np.abs(x - y))))
        scale = max(scale, float(np.max(np.abs(x))))
    return diff, scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="checkout of the old code (e.g. a git worktree)")
    parser.add_argument("--after", default=str(HERE.parent), help="checkout of the new code")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds (9; quick 5)")
    parser.add_argument("--calls", type=int, default=3, help="calls per request, at least")
    parser.add_argument(
        "--min-time", type=float, default=0.5, help="seconds per request, at least (<= 50 calls)"
    )
    parser.add_argument("--quick", action="store_true", help="small shapes")
    parser.add_argument("--cases", nargs="*", help="substrings: keep matching cases only")
    parser.add_argument("--dim", type=int, help="override K = V of every case")
    parser.add_argument("--seq", type=int, help="override T of every case")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per request")
    parser.add_argument(
        "--stall",
        type=float,
        default=30,
        help="seconds of frozen worker CPU time that count as a hang (a known deadlock)",
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="fresh workers per item and side after hangs"
    )
    parser.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if not args.before:
        parser.error("--before is required")
    sys.path.insert(0, str(HERE))
    from _common import machine_line, paired_ratio, print_table

    rounds = args.rounds or (5 if args.quick else 9)
    cases = QUICK_CASES if args.quick else FULL_CASES
    if args.cases:
        cases = {k: v for k, v in cases.items() if any(s in k for s in args.cases)}
    if args.dim or args.seq:
        cases = {
            f"{k} [d={args.dim or v[1]['d']}, t={args.seq or v[1]['t']}]": (
                v[0],
                dict(v[1], d=args.dim or v[1]["d"], t=args.seq or v[1]["t"]),
            )
            for k, v in cases.items()
        }
    items = [(c, p) for c in cases for p in PASSES]

    tmp = tempfile.mkdtemp(prefix="before_after_")
    # Each side's package is copied once, here, so that edits to a checkout during the run
    # (or between a hung worker and its replacement) cannot mix two versions into one side.
    snapshots = {}
    for name, checkout in [("before", args.before), ("after", args.after)]:
        checkout = os.path.abspath(checkout)
        rev = subprocess.run(
            ["git", "-C", checkout, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        src = os.path.join(tmp, name, "src")
        shutil.copytree(
            os.path.join(checkout, "deltanet_cp"),
            os.path.join(src, "deltanet_cp"),
            ignore=shutil.ignore_patterns("__pycache__"),
        )
        digest = hashlib.sha256()
        for f in sorted(pathlib.Path(src).rglob("*.py")):
            digest.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
        snapshots[name] = (checkout, rev, digest.hexdigest()[:12], src)
    # One worker per side and case: a deadlocked worker (see --stall) is replaced without
    # recompiling the other cases.
    workers: dict[tuple[str, str], Side] = {}
    for name in ("before", "after"):
        for i, case in enumerate(cases):
            out_dir = os.path.join(tmp, name, str(i))
            os.makedirs(out_dir)
            workers[(name, case)] = Side(name, snapshots[name][3], out_dir, args.stall)

    print(f"# before/after: {len(items)} items, {rounds} rounds x {args.calls} calls")
    print(f"machine: {machine_line()}")
    failed = {}  # (side, case, pass) -> reason; that side is not asked about that item again
    for name in ("before", "after"):
        side = workers[(name, next(iter(cases)))]
        try:
            side.start(args.timeout)
        except (Hung, WorkerError) as e:
            print(f"\n{name} ({snapshots[name][0]}) failed to start:\n{e}")
            for w in workers.values():
                w.kill()
            sys.exit(1)
        info = side.info or {}
        checkout, rev, digest, _ = snapshots[name]
        print(
            f"{name}: {checkout} (git {rev}; sha256 of its deltanet_cp/**/*.py {digest}),"
            f" run from the copy {info['file']}, jax {info['jax']},"
            f" XLA_FLAGS={info['xla_flags']!r}"
        )

    setup: dict[tuple, dict] = {}  # (side, case, pass) -> first successful setup reply
    hangs: dict[tuple, int] = {}  # (side, case, pass) -> hangs seen (each one a fresh worker)

    def ask(side: Side, item: tuple, op: str) -> dict:
        """`op` ("setup" or "time") for `item` on `side`, setting the item up in the worker
        first where needed; a hang kills the worker and, up to `--retries` times per item and
        side, starts a fresh one (which sets up its items again, lazily) and tries again."""
        case, pass_name = item
        fn_name, shape = cases[case]
        key = (side.name, *item)
        while True:
            try:
                if side.proc is None or side.proc.poll() is not None:
                    side.start(args.timeout)
                if item not in side.ready:
                    reply = side.request(
                        args.timeout,
                        op="setup",
                        case=case,
                        fn=fn_name,
                        shape=shape,
                        index=items.index(item),
                        **{"pass": pass_name},
                    )
                    side.ready.add(item)
                    setup.setdefault(key, reply)
                    if op == "setup":
                        return reply
                return side.request(
                    args.timeout,
                    op="time",
                    case=case,
                    calls=args.calls,
                    min_time=args.min_time,
                    **{"pass": pass_name},
                )
            except Hung as e:
                hangs[key] = hangs.get(key, 0) + 1
                print(f"  HANG {side.name} {case} / {pass_name} ({op}): {e}", flush=True)
                side.kill()
                if hangs[key] > args.retries:
                    raise

    def run(side: Side, item: tuple, op: str) -> dict | None:
        try:
            return ask(side, item, op)
        except Hung as e:
            failed[(side.name, *item)] = f"hung {hangs[(side.name, *item)]} times ({e})"
        except WorkerError as e:
            failed[(side.name, *item)] = f"error in {op}:\n{e}"
            if side.proc is not None and side.proc.poll() is not None:
                side.kill()
        return None

    t0 = time.perf_counter()
    for item in items:
        for name in ("before", "after"):
            run(workers[(name, item[0])], item, "setup")
        compile_s = [
            f"{setup[(n, *item)]['compile_s']:.1f} s" if (n, *item) in setup else "FAILED"
            for n in ("before", "after")
        ]
        print(
            f"  set up {item[0]} / {item[1]}: compile {compile_s[0]} before, {compile_s[1]} after",
            flush=True,
        )
    print(f"setup took {time.perf_counter() - t0:.0f} s", flush=True)

    # (side, case, pass) -> per round: the median and the minimum of the request's calls
    times: dict[tuple, list[float]] = {(s, *it): [] for s in ("before", "after") for it in items}
    mins: dict[tuple, list[float]] = {(s, *it): [] for s in ("before", "after") for it in items}
    solo: dict[tuple, list[float]] = {(s, *it): [] for s in ("before", "after") for it in items}
    ncalls: list[int] = []
    t0 = time.perf_counter()
    for r in range(rounds):
        for item in items:
            order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
            got = {}
            for name in order:
                if (name, *item) not in failed:
                    reply = run(workers[(name, item[0])], item, "time")
                    if reply is not None:
                        got[name] = reply["times"]
            if len(got) == 2:  # keep the rounds paired
                for name, t in got.items():
                    times[(name, *item)].append(statistics.median(t))
                    mins[(name, *item)].append(min(t))
                    ncalls.append(len(t))
            elif len(got) == 1 and any((n, *item) in failed for n in ("before", "after")):
                for name, t in got.items():  # the other side is gone: time this one alone
                    solo[(name, *item)].append(statistics.median(t))
        print(f"  round {r + 1}/{rounds} done, {time.perf_counter() - t0:.0f} s", flush=True)
    for w in workers.values():
        w.close()

    rows = []
    for item in items:
        case, pass_name = item
        before, after = times[("before", *item)], times[("after", *item)]
        if not before:
            cells = [
                f"{statistics.median(solo[(n, *item)]) * 1e3:.1f} (alone)"
                if solo[(n, *item)]
                else ("FAILED" if (n, *item) in failed else "-")
                for n in ("before", "after")
            ]
            rows.append([case, pass_name, *cells, "-", "-", "-", "-", "failed (see below)"])
            continue
        gone = [n for n in ("before", "after") if (n, *item) in failed]
        note = f" [{'+'.join(gone)} failed after {len(before)} rounds]" if gone else ""
        ratios = sorted(a / b for a, b in zip(after, before))
        ratio = paired_ratio(after, before)
        ratio_min = paired_ratio(mins[("after", *item)], mins[("before", *item)])
        sb, sa = setup[("before", *item)], setup[("after", *item)]
        diff, scale = max_abs_diff(sb["outputs"], sa["outputs"])
        finite = "" if sb["finite"] and sa["finite"] else " (non-finite!)"
        rows.append(
            [
                case,
                pass_name,
                f"{statistics.median(before) * 1e3:.1f}",
                f"{statistics.median(after) * 1e3:.1f}",
                f"{ratio:.3f}",
                f"{ratios[0]:.3f}-{ratios[-1]:.3f}",
                f"{1 / ratio:.3f}",
                f"{ratio_min:.3f}",
                f"{diff:.2e} (max |out| {scale:.1e}){finite}{note}",
            ]
        )
    print_table(
        [
            "case",
            "pass",
            "before ms",
            "after ms",
            "after/before",
            "ratio min-max",
            "speedup",
            "after/before (min)",
            "max |after - before|",
        ],
        rows,
        title=(
            f"float32, B=1, K=V={next(iter(cases.values()))[1]['d']}, chunk {CHUNK},"
            f" YNNPACK off; ms: median over {rounds} rounds of the median of a request's"
            f" {min(ncalls or [0])}-{max(ncalls or [0])} calls; after/before: median of"
            " per-round time ratios (<1: after faster); speedup = 1 / that; (min): the same"
            " with each request's fastest call instead of its median"
        ),
    )
    print_table(
        ["case", "pass", "compile s before", "compile s after"],
        [
            [
                c,
                p,
                f"{setup[('before', c, p)]['compile_s']:.1f}",
                f"{setup[('after', c, p)]['compile_s']:.1f}",
            ]
            for c, p in items
            if ("before", c, p) in setup and ("after", c, p) in setup
        ],
        title="Compile times (one compile each, informational, not paired)",
    )
    for key, n in hangs.items():
        print(f"\nhangs: {key[0]} {key[1]} / {key[2]}: {n} (worker killed and restarted)")
    for key, why in failed.items():
        print(f"\nFAILED {key[0]} {key[1]} / {key[2]}: {why}")
    print(f"\nmachine after: {machine_line()}; worker logs and outputs in {tmp}")


if __name__ == "__main__":
    main()

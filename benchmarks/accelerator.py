"""Ours vs flash-linear-attention's Triton kernel vs MaxText's JAX kernel, on one GPU.

The chunked gated delta rule at Qwen3-Next heads (B=1, H=16, HV=32, K=V=128, chunk 64,
q/k L2 norm on), bfloat16 and float32, T = 4096, 16384 and 65536, forward and
forward+backward (the backward of `o` and the final state `h_T` with fixed random
cotangents, gradients of q, k, v, g and beta). Three peers:

- ours: `deltanet_cp.chunk_gated_delta_rule` (jitted);
- FLA: `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (Triton; the `fla-core` wheel),
  `use_qk_l2norm_in_kernel=True`, v with more heads than q/k natively;
- MaxText 0.2.5: `jax_chunk_gated_delta_rule` read from `maxtext/models/qwen3.py` without
  importing the package (see `benchmarks/_maxtext.py`), q/k repeated to the value heads,
  `compute_dtype` = the case's dtype.

q, k, v and beta are in the case's dtype, g (log decay) in float32 for all three. Prints
tokens/s (median over paired rounds: each round runs every call once, the order rotating;
the speed ratios are medians of the per-round ratios), peak memory per call (ours and
MaxText: XLA's compiled `memory_analysis()`, arguments + outputs + temporaries; FLA:
`torch.cuda.max_memory_allocated()` over the call, inputs included) and the largest
relative difference of the outputs (last 256 tokens of `o`, and `h_T`).

JAX and PyTorch run in two worker processes (each framework owns its GPU memory pool; JAX
without preallocation), driven in lockstep: one call at a time on the GPU. The whole run
stops within `--budget` seconds (default 450, so the command ends within 8 minutes): a
case that would start after that is skipped and listed as such.

Preparing a machine with no network: on a machine with one, download the wheels that the
CUDA machine lacks into one directory and carry it over (it is read, never committed):

    make bench-gpu-wheels        # = the two commands below, into ./wheels
    pip download --no-deps -d wheels fla-core einops equinox jaxtyping wadler-lindig
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels maxtext==0.2.5

This script installs (`pip install --no-deps --no-index`) each wheel in `--wheels` whose
module is not importable yet (falling back to unpacking it into a temporary directory
when pip cannot install), except MaxText's, which is read straight from the wheel file.
`deltanet_cp` itself is imported from this checkout. Then:

    make bench-gpu               # python benchmarks/accelerator.py --wheels wheels
    python benchmarks/accelerator.py --quick    # CPU, tiny shapes, FLA skipped
"""

import argparse
import glob
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MARK = "@@ "
CHUNK = 64
# (B, H, HV, K = V) and the sequence lengths; --quick: tiny, for a CPU.
FULL = dict(b=1, h=16, hv=32, d=128, ts=[4096, 16384, 65536], rounds=5)
QUICK = dict(b=1, h=2, hv=4, d=32, ts=[256], rounds=2)
DTYPES = ["bfloat16", "float32"]
PASSES = ["fwd", "fwd+bwd"]
PEERS = ["ours", "fla", "maxtext"]
NAMES = {"ours": "ours", "fla": "FLA", "maxtext": "MaxText"}
SAMPLE = 256  # tokens of `o` compared between peers (the last ones: they see every state)


# ------------------------------------------------------------------ wheels and imports


def _module_of(wheel: str) -> str:
    """Top-level import name of a wheel (from top_level.txt, or the name's first part)."""
    with zipfile.ZipFile(wheel) as z:
        tops = [n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")]
        if tops:
            names = z.read(tops[0]).decode().split()
            if names:
                return names[0]
        packages = {n.split("/")[0] for n in z.namelist() if "/" in n}
        packages = {p for p in packages if not p.endswith((".dist-info", ".data"))}
        if len(packages) == 1:
            return packages.pop()
    return os.path.basename(wheel).split("-")[0].replace("-", "_").lower()


def install_wheels(directory: str | None, log) -> str | None:
    """Make every wheel in `directory` importable, unless its module already is.

    MaxText's wheel is skipped (it is read, not installed: its metadata wants Python 3.12
    and its imports want flax). Returns a directory to put on `PYTHONPATH` when pip could
    not install and the wheels were unpacked there instead.
    """
    import importlib.util

    if not directory or not os.path.isdir(directory):
        return None
    missing = []
    for wheel in sorted(glob.glob(os.path.join(directory, "*.whl"))):
        name = _module_of(wheel)
        if name == "maxtext":
            continue
        if importlib.util.find_spec(name) is None:
            missing.append((name, wheel))
    if not missing:
        return None
    wheels = [w for _, w in missing]
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    done = subprocess.run(command + wheels, capture_output=True, text=True)
    if done.returncode == 0:
        log(f"installed with pip --no-deps: {', '.join(os.path.basename(w) for w in wheels)}")
        return None
    # No pip, or a read-only environment: pure-Python wheels unpack as they are.
    target = tempfile.mkdtemp(prefix="bench-wheels-")
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    log(
        f"pip could not install ({done.stderr.strip().splitlines()[-1:]}); unpacked "
        f"{', '.join(os.path.basename(w) for w in wheels)} into {target}"
    )
    return target


def import_ours():
    """`deltanet_cp` from this checkout (given metadata if it was never pip-installed)."""
    import importlib.metadata

    sys.path.insert(0, ROOT)
    try:
        importlib.metadata.version("deltanet_cp")
    except importlib.metadata.PackageNotFoundError:
        # The package reads its version from its metadata; a checkout that was never
        # installed has none, so give it some (a dist-info directory on sys.path).
        site = tempfile.mkdtemp(prefix="bench-meta-")
        info = os.path.join(site, "deltanet_cp-0.0.0+checkout.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: deltanet_cp\nVersion: 0.0.0+checkout\n")
        sys.path.append(site)
    import deltanet_cp

    return deltanet_cp


# ------------------------------------------------------------------ workers


def reply(**record):
    print(MARK + json.dumps(record), flush=True)


def make_inputs(shape, t):
    """float32 numpy inputs and cotangents, the same in both workers."""
    import numpy as np
    from _common import gdn_inputs

    b, hv, d = shape["b"], shape["hv"], shape["d"]
    inputs = gdn_inputs(np.random.default_rng(0), b, t, shape["h"], hv, d)
    rng = np.random.default_rng(1)
    d_o = rng.standard_normal((b, t, hv, d), dtype=np.float32)
    d_h = rng.standard_normal((b, hv, d, d), dtype=np.float32)
    return inputs, (d_o, d_h)


def save_sample(path, o, h_t):
    import numpy as np

    np.savez(path, o=np.asarray(o, np.float32)[:, -SAMPLE:], h=np.asarray(h_t, np.float32))


def serve(handlers):
    """Answer JSON commands from stdin, one line each, until `quit` or end of input."""
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            reply(**handlers[command["op"]](**command.get("args", {})))
        except Exception as e:  # an out-of-memory at 64k tokens is a result, not a crash
            reply(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])


def jax_worker(args):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
    import jax
    import jax.numpy as jnp

    shape = QUICK if args.quick else FULL
    peers, skipped = {}, {}
    try:
        dcp = import_ours()
        peers["ours"] = dcp
    except Exception as e:
        skipped["ours"] = f"import failed: {e}"
    mt = None
    try:
        from _maxtext import find_wheel, load_maxtext

        try:
            mt = load_maxtext()
        except ImportError:
            wheel = find_wheel(args.wheels) if args.wheels else None
            if wheel is None:
                raise ImportError("not installed and no maxtext-*.whl in --wheels") from None
            mt = load_maxtext(wheel=wheel)
        peers["maxtext"] = mt
    except Exception as e:
        skipped["maxtext"] = f"{type(e).__name__}: {e}"
    for p in args.skip:
        if p in peers:
            del peers[p]
            skipped[p] = "failed in an earlier call (see above)"
    state = {}

    def setup():
        device = jax.devices()[0]
        return dict(
            jax=jax.__version__,
            backend=jax.default_backend(),
            device=str(getattr(device, "device_kind", device)),
            peers=list(peers),
            skipped=skipped,
            maxtext=None if mt is None else f"{mt.version} ({mt.where})",
        )

    def case(t, dtype):
        state.clear()
        inputs, cot = make_inputs(shape, t)
        dt = jnp.dtype(dtype)
        q, k, v, g, beta = (jnp.asarray(x) for x in inputs)
        state["args"] = (q.astype(dt), k.astype(dt), v.astype(dt), g, beta.astype(dt))
        state["cot"] = cot
        state["dtype"] = dt
        state["t"] = t
        return {}

    def forward_of(peer):
        dt, hv, d = state["dtype"], shape["hv"], shape["d"]
        if peer == "ours":
            dcp = peers["ours"]

            def forward(q, k, v, g, beta):
                return dcp.chunk_gated_delta_rule(
                    q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, chunk_size=CHUNK
                )

            return forward
        rep = hv // shape["h"]

        def forward(q, k, v, g, beta):
            q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
            return mt.jax_chunk_gated_delta_rule(
                q,
                k,
                v,
                g,
                beta,
                chunk_size=CHUNK,
                initial_state=jnp.zeros((q.shape[0], hv, d, d), jnp.float32),  # to get h_T
                use_qk_norm_in_gdn=True,
                compute_dtype=dt,
            )

        return forward

    def prepare(peer, pass_, sample=None):
        forward = forward_of(peer)
        a = state["args"]
        if pass_ == "fwd":
            fn, fargs = forward, a
        else:
            out = jax.eval_shape(forward, *a)
            cot = tuple(jnp.asarray(c, o.dtype) for c, o in zip(state["cot"], out))

            def fn(a, cot):
                return jax.vjp(forward, *a)[1](cot)

            fargs = (a, cot)
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*fargs).compile()
        compile_s = time.perf_counter() - start
        m = compiled.memory_analysis()
        peak = None
        if m is not None:
            peak = (
                m.argument_size_in_bytes
                + m.output_size_in_bytes
                + m.temp_size_in_bytes
                - m.alias_size_in_bytes
            )
        result = jax.block_until_ready(compiled(*fargs))
        if sample:
            save_sample(sample, *result)
        del result
        state[(peer, pass_)] = (compiled, fargs)
        return dict(compile_s=compile_s, peak_bytes=peak, peak_kind="compiled")

    def run(peer, pass_):
        compiled, fargs = state[(peer, pass_)]
        start = time.perf_counter()
        jax.block_until_ready(compiled(*fargs))
        return dict(s=time.perf_counter() - start)

    def drop():
        state.clear()
        return {}

    serve(dict(setup=setup, case=case, prepare=prepare, run=run, drop=drop))


def torch_worker(args):
    shape = QUICK if args.quick else FULL
    skipped, state = {}, {}
    fla = None
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        import triton  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    except Exception as e:
        skipped["fla"] = f"{type(e).__name__}: {e}"
    if "fla" in args.skip:
        fla, skipped["fla"] = None, "failed in an earlier call (see above)"

    def setup():
        if fla is None:
            return dict(peers=[], skipped=skipped)
        import fla as fla_package
        import torch
        import triton

        version = getattr(fla_package, "__version__", "?")
        return dict(
            peers=["fla"],
            skipped={},
            torch=torch.__version__,
            triton=triton.__version__,
            fla=f"{version} ({os.path.dirname(fla_package.__file__)})",
        )

    def case(t, dtype):
        import torch

        state.clear()
        torch.cuda.empty_cache()
        inputs, cot = make_inputs(shape, t)
        dt = getattr(torch, dtype)
        q, k, v, g, beta = (torch.from_numpy(x).cuda() for x in inputs)
        state["args"] = (q.to(dt), k.to(dt), v.to(dt), g, beta.to(dt))
        state["cot"] = (torch.from_numpy(cot[0]).cuda().to(dt), torch.from_numpy(cot[1]).cuda())
        return {}

    def forward(q, k, v, g, beta):
        return fla(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def call(pass_):
        import torch

        a = state["args"]
        if pass_ == "fwd":
            with torch.no_grad():
                return forward(*a)
        leaves = [x.detach().requires_grad_(True) for x in a]
        o, h_t = forward(*leaves)
        cot = (state["cot"][0].to(o.dtype), state["cot"][1].to(h_t.dtype))
        torch.autograd.backward([o, h_t], list(cot))
        return [x.grad for x in leaves]

    def prepare(peer, pass_, sample=None):
        import torch

        start = time.perf_counter()
        call(pass_)  # the first call compiles and autotunes the Triton kernels
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        torch.cuda.reset_peak_memory_stats()
        result = call(pass_)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        if sample:
            save_sample(sample, *(x.float().cpu().numpy() for x in result))
        del result
        return dict(compile_s=compile_s, peak_bytes=peak, peak_kind="allocated")

    def run(peer, pass_):
        import torch

        torch.cuda.synchronize()
        start = time.perf_counter()
        call(pass_)
        torch.cuda.synchronize()
        return dict(s=time.perf_counter() - start)

    def drop():
        state.clear()
        return {}

    serve(dict(setup=setup, case=case, prepare=prepare, run=run, drop=drop))


# ------------------------------------------------------------------ driver


class Gone(Exception):
    """A worker died, hung or ran out of the time budget; `why` says which."""

    def __init__(self, why):
        super().__init__(why)
        self.why = why


class Worker:
    """A worker process answering one command at a time."""

    def __init__(self, kind, argv, hang_after):
        self.kind, self.hang_after = kind, hang_after
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", kind, *argv],
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self.lines.put(json.loads(line[len(MARK) :]))
        self.lines.put(None)

    def send(self, op, **args):
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()

    def wait(self, deadline):
        """The reply to the last command; `Gone` if the worker ends, hangs or time is up."""
        from _common import cpu_seconds

        last_cpu, progress = -1.0, time.monotonic()
        while True:
            try:
                record = self.lines.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    self.kill()
                    raise Gone("time budget") from None
                cpu = cpu_seconds(self.proc.pid)
                if cpu is not None and cpu > last_cpu + 0.05:
                    last_cpu, progress = cpu, now
                if self.hang_after and now - progress > self.hang_after:
                    self.kill()
                    raise Gone("hang") from None
                continue
            if record is None:
                self.proc.wait()
                tail = " ".join("".join(self.stderr[-3:]).split())[-300:]
                raise Gone(f"worker exited ({self.proc.returncode}): {tail}")
            return record

    def ask(self, deadline, op, **args):
        self.send(op, **args)
        return self.wait(deadline)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=10)
            except Exception:
                pass
        self.kill()


def rel_diff(a, b):
    import numpy as np

    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run_case(res, workers, available, dtype, t, rounds, deadline, tmp):
    """One case into `res`; returns `{worker kind: (peer or None, why)}` for workers lost."""
    faults = {}
    live = {k: w for k, w in workers.items() if k in available.values()}

    def ask_all(requests):
        """Send one command to each worker, then collect the replies (None if it was lost)."""
        for kind, (op, a) in requests.items():
            live[kind].send(op, **a)
        replies = {}
        for kind, (op, a) in requests.items():
            try:
                replies[kind] = live[kind].wait(deadline)
            except Gone as e:
                faults[kind] = (a.get("peer"), e.why)
                replies[kind] = None
        for kind in faults:
            live.pop(kind, None)
        return replies

    for kind, r in ask_all({k: ("case", dict(t=t, dtype=dtype)) for k in live}).items():
        if r is not None and "error" in r:
            for p in PEERS:
                if available.get(p) == kind:
                    res["prep"].update({(p, s): r for s in PASSES})
            live.pop(kind, None)
    # Prepare: the two workers compile (and FLA autotunes) side by side.
    todo = {k: [(p, s) for p in PEERS if available.get(p) == k for s in PASSES] for k in live}
    calls = []
    while not faults and any(todo.get(k) for k in live):
        requests = {}
        for kind in live:
            if todo[kind]:
                p, s = todo[kind].pop(0)
                sample = os.path.join(tmp, f"{p}-{dtype}-{t}.npz") if s == "fwd" else None
                requests[kind] = ("prepare", dict(peer=p, pass_=s, sample=sample))
        for kind, r in ask_all(requests).items():
            p, s = requests[kind][1]["peer"], requests[kind][1]["pass_"]
            if r is not None:
                res["prep"][(p, s)] = r
                if "error" not in r:
                    calls.append((p, s))
    # Paired rounds: one call at a time on the device, the order rotating.
    for i in range(rounds if not faults else 0):
        for p, s in calls[i % len(calls) :] + calls[: i % len(calls)]:
            kind = available[p]
            if kind not in live:
                continue
            r = ask_all({kind: ("run", dict(peer=p, pass_=s))})[kind]
            if r is None:
                break
            if "error" in r:
                res["prep"][(p, s)] = r
                calls.remove((p, s))
                continue
            res["times"].setdefault((p, s), []).append(r["s"])
        if faults:
            break
    if not faults:
        ask_all({k: ("drop", {}) for k in live})
    return faults


def compare(tmp, dtype, t):
    """Largest relative differences `(o, h_T)` between the peers' saved forward outputs."""
    import numpy as np

    samples = {}
    for p in PEERS:
        path = os.path.join(tmp, f"{p}-{dtype}-{t}.npz")
        if os.path.exists(path):
            with np.load(path) as z:
                samples[p] = (z["o"], z["h"])
    return {
        (a, b): (rel_diff(samples[a][0], samples[b][0]), rel_diff(samples[a][1], samples[b][1]))
        for a in samples
        for b in samples
        if PEERS.index(a) < PEERS.index(b)
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, FLA skipped")
    parser.add_argument("--wheels", default=None, help="directory of wheels to install from")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    parser.add_argument("--repeats", type=int, default=None, help="paired rounds per case")
    parser.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--skip", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.wheels is None and os.path.isdir(os.path.join(ROOT, "wheels")):
        args.wheels = os.path.join(ROOT, "wheels")
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)
    if args.worker == "jax":
        return jax_worker(args)
    if args.worker == "torch":
        return torch_worker(args)

    sys.path.insert(0, HERE)
    from _common import machine_line, paired_ratio, print_table

    start = time.monotonic()
    deadline = start + args.budget
    shape = QUICK if args.quick else FULL
    rounds = args.repeats or shape["rounds"]
    common = (["--quick"] if args.quick else []) + (
        ["--wheels", args.wheels] if args.wheels else []
    )
    hang_after = 30 if args.quick else 0  # CPU only: jaxlib's triangular solve can deadlock
    print(f"machine: {machine_line()}; time budget {args.budget:.0f} s", flush=True)
    unpacked = install_wheels(args.wheels, print)  # once, before the workers start
    if unpacked:
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = unpacked + (os.pathsep + path if path else "")
    notes = []

    workers, available, skipped = {}, {}, {}
    if args.quick:
        skipped["fla"] = "--quick runs on the CPU; FLA's Triton kernels need CUDA"
    kinds = ["jax"] if args.quick else ["jax", "torch"]
    info = {}
    for kind in kinds:
        try:
            w = Worker(kind, common, hang_after)
            setup = w.ask(deadline, "setup")
        except Gone as e:
            print(f"{kind} worker: {e.why}")
            continue
        if "error" in setup:
            print(f"{kind} worker: {setup['error']}")
            w.close()
            continue
        if not setup["peers"]:
            w.close()
        else:
            workers[kind] = w
        info.update({k: v for k, v in setup.items() if k not in ("peers", "skipped")})
        skipped.update(setup["skipped"])
        for p in setup["peers"]:
            available[p] = kind
    if "jax" in workers and info.get("backend") == "cpu" and not args.quick:
        print("jax sees no GPU (backend cpu): run with --quick on a CPU")
        for w in workers.values():
            w.close()
        return 1
    print(
        f"jax {info.get('jax', '?')} on {info.get('backend', '?')} ({info.get('device', '?')}); "
        f"torch {info.get('torch', '-')}, triton {info.get('triton', '-')}"
    )
    print(f"FLA: {info.get('fla', 'skipped: ' + skipped.get('fla', '?'))}")
    print(f"MaxText: {info.get('maxtext') or 'skipped: ' + skipped.get('maxtext', '?')}")
    print(
        f"B={shape['b']}, H={shape['h']}, HV={shape['hv']}, K=V={shape['d']}, chunk {CHUNK}, "
        f"q/k L2 norm on; {rounds} paired rounds per case",
        flush=True,
    )

    results = {}  # (dtype, t) -> {"times": {(peer, pass): [s]}, "prep": {...}, "diff": {...}}
    tmp = tempfile.mkdtemp(prefix="bench-gpu-")
    budget_out = False
    for t in shape["ts"]:
        for dtype in DTYPES:
            if budget_out or time.monotonic() > deadline:
                budget_out = True
                results[(dtype, t)] = {"status": "time budget: not run"}
                continue
            res = results[(dtype, t)] = {"times": {}, "prep": {}, "status": "ok"}
            faults = run_case(res, workers, available, dtype, t, rounds, deadline, tmp)
            for kind, (peer, why) in faults.items():
                res["status"] = why
                if why == "time budget":
                    budget_out = True
                    continue
                # a hang or a crash: restart that worker without the peer at fault
                notes.append(f"{NAMES.get(peer, kind)} at {dtype}, T={t}: {why}")
                if peer:
                    available.pop(peer, None)
                    skipped[peer] = f"{why} at {dtype}, T={t}"
                    args.skip.append(peer)
                skip = [x for p in args.skip for x in ("--skip", p)]
                try:
                    workers[kind] = Worker(kind, common + skip, hang_after)
                    workers[kind].ask(deadline, "setup")
                except Gone:
                    del workers[kind]
            if budget_out:
                for w in workers.values():
                    w.kill()
            res["diff"] = compare(tmp, dtype, t)
            print(
                f"{dtype}, T={t}: {res['status']}, {time.monotonic() - start:.0f} s so far",
                flush=True,
            )
    for w in workers.values():
        w.close()

    def tokens_per_s(res, p, s, t):
        ts = res.get("times", {}).get((p, s))
        if ts:
            return f"{t / statistics.median(ts) / 1e3:,.0f}k"
        prep = res.get("prep", {}).get((p, s))
        if isinstance(prep, dict) and "error" in prep:
            return prep["error"].split(":")[0]
        if p in skipped and p not in available:
            return "skipped"
        return "-" if res.get("status") == "ok" else res.get("status", "-").split(":")[0]

    def speed(res, num, den, s):
        a, b = res.get("times", {}).get((num, s)), res.get("times", {}).get((den, s))
        if not a or not b:
            return "-"
        n = min(len(a), len(b))
        return f"{paired_ratio(a[:n], b[:n]):.2f}x"

    def peak(res, p, s):
        prep = res.get("prep", {}).get((p, s))
        if isinstance(prep, dict) and prep.get("peak_bytes") is not None:
            return f"{prep['peak_bytes'] / 2**20:,.0f}"
        return "-"

    rows, diff_rows = [], []
    for (dtype, t), res in results.items():
        for s in PASSES:
            rows.append(
                [dtype, t, s]
                + [tokens_per_s(res, p, s, t) for p in PEERS]
                + [speed(res, "fla", "ours", s), speed(res, "maxtext", "ours", s)]
                + [peak(res, p, s) for p in PEERS]
                + [len(res.get("times", {}).get(("ours", s), []))]
            )
        d = res.get("diff", {})
        diff_rows.append(
            [dtype, t]
            + [f"{d[k][0]:.1e}" if k in d else "-" for k in [("ours", "fla"), ("ours", "maxtext")]]
            + [f"{d[k][0]:.1e}" if k in d else "-" for k in [("fla", "maxtext")]]
            + [f"{d[k][1]:.1e}" if k in d else "-" for k in [("ours", "fla"), ("ours", "maxtext")]]
        )
    print_table(
        [
            "dtype",
            "T",
            "pass",
            "ours tok/s",
            "FLA tok/s",
            "MaxText tok/s",
            "ours / FLA speed",
            "ours / MaxText speed",
            "ours peak MiB",
            "FLA peak MiB",
            "MaxText peak MiB",
            "rounds",
        ],
        rows,
        title="Chunked gated delta rule: tokens/s (median over paired rounds; speed = median "
        "of per-round time ratios, > 1: ours faster); peak memory of one call (ours, MaxText: "
        "XLA's compiled arguments + outputs + temporaries; FLA: torch max_memory_allocated)",
    )
    print_table(
        [
            "dtype",
            "T",
            "o: ours vs FLA",
            "o: ours vs MaxText",
            "o: FLA vs MaxText",
            "h_T: ours vs FLA",
            "h_T: ours vs MaxText",
        ],
        diff_rows,
        title=f"Largest relative difference of outputs (last {SAMPLE} tokens of o; final state)",
    )
    for p, why in skipped.items():
        notes.append(f"{NAMES[p]} skipped: {why}")
    if budget_out:
        notes.append(f"time budget ({args.budget:.0f} s) spent: the cases marked so were not run")
    if notes:
        print()
    for n in dict.fromkeys(notes):
        print(n)
    print(f"whole run {time.monotonic() - start:.0f} s; machine: {machine_line()}")


if __name__ == "__main__":
    sys.exit(main())

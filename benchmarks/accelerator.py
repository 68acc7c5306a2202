"""Ours vs flash-linear-attention's Triton kernel vs MaxText's JAX kernel, on one GPU.

Two parts, both at Qwen3-Next heads (B=1, H=16, HV=32, K=V=128, chunk 64, q/k L2 norm on):

1. **Structure** (`depth.py`, compiled for the GPU, nothing run): the sequential depth (ops
   inside while loops x trips, per token: on a GPU each is roughly one kernel launch on
   the critical path), the ops outside loops, and compiled temporaries per token, for ours,
   MaxText and (when its wheel is there) jax-linear-attention's plain-JAX path, T=4096.
2. **Paired time** through `_harness.py`: bfloat16 and float32, T = 4096, 16384 and 65536,
   forward and forward+backward (the pullback of fixed cotangents of `o` and the final
   state to q, k, v, g and beta). Four implementations, each in its own process (three JAX
   processes without preallocation, one PyTorch process), stopped while another is timed:
   - ours: `deltanet_cp.chunk_gated_delta_rule` (its default policy: bfloat16 products
     with float32 accumulation for bfloat16 inputs, float32 HIGHEST for float32 ones);
   - ours highest: the same with `precision="highest"` (float32 products for both);
   - FLA: `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (Triton; the `fla-core` wheel);
   - MaxText 0.2.5: `jax_chunk_gated_delta_rule` (`_maxtext.py`), `compute_dtype` = the
     case's dtype.
   q, k, v and beta in the case's dtype, g in float32 for all. Prints tokens/s (median over
   paired rounds), our speedups (median of per-round ratios), peak memory of one call
   (JAX: compiled arguments + outputs + temporaries; FLA: `torch.cuda.max_memory_allocated`)
   and the largest relative differences of the outputs (last 256 tokens of `o`; `h_T`).

The run stops within `--budget` seconds (450 by default, so the command ends within 8
minutes): cases that would start later are reported as `budget`. A GPU worker may wait
without using the CPU, so hangs are caught by a wall timeout per command there; on the CPU
(`--quick`) by the CPU-time check too.

Preparing a machine with no network: where there is one, download what the CUDA machine
lacks into one directory and carry it over (it is read, never committed):

    make bench-gpu-wheels        # into ./wheels: fla-core, einops, equinox, jaxtyping,
                                 # wadler-lindig; maxtext and jax-linear-attention for 3.12

This script installs (`pip install --no-deps --no-index`) each wheel in `--wheels` whose
module is not importable yet (falling back to unpacking it into a temporary directory when
pip cannot install), except MaxText's and jax-linear-attention's, which are read from
their wheel files. `deltanet_cp` is imported from this checkout. Then:

    make bench-gpu               # python benchmarks/accelerator.py --wheels wheels
    python benchmarks/accelerator.py --quick    # CPU, tiny shapes, FLA skipped
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time
import zipfile


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _common import machine_line, print_table  # noqa: E402
from _harness import Impl, max_rel_diff, Session  # noqa: E402


CHUNK = 64
FULL = dict(b=1, h=16, hv=32, d=128, ts=[4096, 16384, 65536], rounds=5, calls=5)
QUICK = dict(b=1, h=2, hv=4, d=32, ts=[256], rounds=3, calls=3)
DTYPES = ["bfloat16", "float32"]
PASSES = ["fwd", "fwd+bwd"]
SAMPLE = 256  # tokens of `o` compared between implementations (the last: they see every state)
READ_NOT_INSTALLED = {"maxtext", "jla"}  # wheels read by _maxtext.py / _jla.py


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

    MaxText's and jla's wheels are skipped (read, not installed: their metadata wants
    Python 3.12). Returns a directory to put on `PYTHONPATH` when pip could not install
    and the wheels were unpacked there instead.
    """
    import importlib.util

    if not directory or not os.path.isdir(directory):
        return None
    missing = []
    for wheel in sorted(glob.glob(os.path.join(directory, "*.whl"))):
        name = _module_of(wheel)
        if name in READ_NOT_INSTALLED:
            continue
        if importlib.util.find_spec(name) is None:
            missing.append(wheel)
    if not missing:
        return None
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    done = subprocess.run(command + missing, capture_output=True, text=True)
    if done.returncode == 0:
        log(f"installed with pip --no-deps: {', '.join(os.path.basename(w) for w in missing)}")
        return None
    # No pip, or a read-only environment: pure-Python wheels unpack as they are.
    target = tempfile.mkdtemp(prefix="bench-wheels-")
    for wheel in missing:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
    log(
        f"pip could not install ({done.stderr.strip().splitlines()[-1:]}); unpacked "
        f"{', '.join(os.path.basename(w) for w in missing)} into {target}"
    )
    return target


def structure(args, deadline) -> None:
    """Run `depth.py` for this machine's default backend, one device; its tables go to stdout."""
    command = [sys.executable, os.path.join(HERE, "depth.py"), "--no-cp"]
    command += ["--quick"] if args.quick else []
    command += ["--wheels", args.wheels] if args.wheels else []
    print("\n## Structure (depth.py, one device)", flush=True)
    try:
        subprocess.run(command, timeout=max(10.0, deadline - time.monotonic()), check=False)
    except subprocess.TimeoutExpired:
        print("depth.py: time budget spent")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, tiny shapes, FLA skipped")
    parser.add_argument("--wheels", default=None, help="directory of wheels to install from")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole run")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds per case")
    parser.add_argument("--no-structure", action="store_true", help="skip the depth tables")
    args = parser.parse_args()
    if args.wheels is None and os.path.isdir(os.path.join(ROOT, "wheels")):
        args.wheels = os.path.join(ROOT, "wheels")
    if args.wheels:
        args.wheels = os.path.abspath(args.wheels)

    start = time.monotonic()
    deadline = start + args.budget
    shape = QUICK if args.quick else FULL
    rounds = args.rounds or shape["rounds"]
    print(f"machine: {machine_line()}; time budget {args.budget:.0f} s", flush=True)
    unpacked = install_wheels(args.wheels, print)  # once, before any worker starts
    if unpacked:
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = unpacked + (os.pathsep + path if path else "")
    if not args.quick:
        probe = "import jax; print(jax.default_backend())"
        backend = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
        if backend.stdout.strip() != "gpu":
            print(f"jax sees no GPU (backend {backend.stdout.strip() or '?'}): use --quick")
            return 1
    if not args.no_structure:
        structure(args, start + args.budget / 4)

    jax_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}
    wheels = {"wheels": args.wheels} if args.wheels else {}
    impls = [
        Impl("ours", "_impls:ours", env=jax_env),
        # The same with float32 products at Precision.HIGHEST on bfloat16 inputs too (ours
        # above runs the bfloat16 policy there: bfloat16 operands, float32 accumulation).
        Impl("ours highest", "_impls:ours", {"precision": "highest"}, env=jax_env),
        Impl("MaxText", "_impls:maxtext", wheels, env=jax_env),
    ]
    notes = []
    if args.quick:
        notes.append("FLA skipped: --quick runs on the CPU; FLA's Triton kernels need CUDA")
    else:
        impls.insert(1, Impl("FLA", "_impls:fla"))
    names = [i.name for i in impls]
    print(
        f"\n## Paired time\n\nB={shape['b']}, H={shape['h']}, HV={shape['hv']}, "
        f"K=V={shape['d']}, chunk {CHUNK}, q/k L2 norm; {rounds} paired rounds per case, "
        f"{shape['calls']} calls per pass per round; one process per implementation",
        flush=True,
    )
    results = {}
    with Session(
        impls,
        hang_after=30 if args.quick else 0,  # a GPU worker may wait without CPU time
        timeout=300,
        deadline=deadline,
        retries=0,
    ) as session:
        for t in shape["ts"]:
            for dtype in DTYPES:
                if time.monotonic() > deadline:
                    results[(dtype, t)] = None
                    continue
                print(f"{dtype}, T={t}:", flush=True)
                case = dict(b=shape["b"], t=t, h=shape["h"], hv=shape["hv"], d=shape["d"])
                session.prepare(**case, chunk=CHUNK, dtype=dtype, passes=PASSES, sample=SAMPLE)
                results[(dtype, t)] = session.time(PASSES, rounds, shape["calls"])
                print(f"  {time.monotonic() - start:.0f} s so far", flush=True)

    info = {}
    for res in results.values():
        if res is not None:
            for n in names:
                if not info.get(n):
                    info[n] = res.outcomes[n].info
    for n in names:
        i = info.get(n) or {}
        extra = f", jax {i['jax']}" if "jax" in i else (f", torch {i['torch']}" if i else "")
        print(f"{n}: {i.get('version', '?')}{extra} on {i.get('device', '?')}")

    rows, diff_rows = [], []
    peers = names[1:]
    for (dtype, t), res in results.items():
        for p in PASSES:
            if res is None:
                rows.append([dtype, t, p] + ["budget"] * (2 * len(names) + len(peers)) + [0])
                continue
            row = [dtype, t, p]
            for n in names:
                m = res.median(n, p)
                row.append(f"{t / m / 1e3:,.0f}k" if m else res.why_missing(n, p))
            for peer in peers:
                r = res.ratio(peer, "ours", p)
                row.append(f"{r:.2f}x" if r is not None else "-")
            for n in names:
                peak = res.outcomes[n].info.get(f"peak_bytes {p}")
                row.append(f"{peak / 2**20:,.0f}" if peak else "-")
            row.append(res.rounds("ours", p))
            rows.append(row)
            notes += [f"{dtype}, T={t}, {x}" for x in res.notes()] if p == "fwd" else []
        if res is None:
            continue
        ref = res.outputs.get("ours")
        cells = []
        for peer in peers:
            out = res.outputs.get(peer)
            if ref is None or out is None:
                cells += ["-", "-"]
            else:
                cells += [f"{max_rel_diff(out[k], ref[k]):.1e}" for k in ("o", "h")]
        diff_rows.append([dtype, t] + cells)

    print_table(
        ["dtype", "T", "pass"]
        + [f"{n} tok/s" for n in names]
        + [f"ours vs {p}" for p in peers]
        + [f"{n} peak MiB" for n in names]
        + ["rounds"],
        rows,
        title="Tokens/s (median over paired rounds); ours vs X = median of per-round X / ours "
        "times (> 1: ours faster); peak memory of one call",
    )
    print_table(
        ["dtype", "T"] + [f"{x}: {p} vs ours" for p in peers for x in ("o", "h_T")],
        diff_rows,
        title=f"Largest relative difference from our outputs (last {SAMPLE} tokens of o; h_T)",
    )
    if notes:
        print("\n" + "\n".join(dict.fromkeys(notes)))
    print(f"\nwhole run {time.monotonic() - start:.0f} s; machine: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

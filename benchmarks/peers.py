"""Ours vs MaxText vs jax-linear-attention vs transformers: time on this CPU, paired.

The chunked gated delta rule, float32, chunk 64, q/k L2 norm on, the final state returned,
B = 1, K = V = 128, at Qwen3-Next's heads (H = 16, HV = 32, T = 2048) and at H = HV = 4,
T = 4096; forward, and forward+backward (the pullback of fixed cotangents of `o` and the
final state to q, k, v, g and beta). Four implementations (`_impls.py`):

- ours: `deltanet_cp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)`, at the
  default `memory="low"` and, as "ours high", at `memory="high"` (the backward keeps every
  chunk's factors);
- MaxText 0.2.5's JAX kernel (`jax_chunk_gated_delta_rule`, `compute_dtype=float32`);
- jax-linear-attention 0.1.0's plain-JAX chunked path (`jla.ops.chunked.gated_delta_rule`);
- transformers' `torch_chunk_gated_delta_rule` (eager PyTorch).

Each runs in its own process, stopped while another is timed; a round times each once,
the order rotating; a ratio is the median over rounds of the per-round ratio
(`_harness.py`). A worker whose CPU time stops for `--hang-after` seconds is reported as a
hang (MaxText's and jla's triangular solve can deadlock on XLA:CPU).

Prints, per shape: medians (ms) and our speedup over each peer; each implementation's
forward+backward / forward; the matmul FLOPs of each JAX implementation's compiled program
(every `dot`, loop bodies times their trips) and the rate it achieves, beside the machine's
float32 matmul rate on the same kind of products measured in the same worker (the CPU's
limit for this work) and as a share of the machine's rate on large square products; the
largest relative difference of each peer's outputs from ours; and the machine's load; then
the compiled temporaries per token. Needs the environment of `make bench`.

The yardstick: after the implementations, in the same run, this CPU's float32 matmul rate
on large square products (2048 x 2048 and 4096 x 4096; 512 and 1024 with `--quick`), through
XLA (`jax.jit` of `a @ b`) and through numpy's BLAS, each in a process of its own with
nothing else of the run alive: what a matmul can reach here when it is large.

With `--family`, the same tables for our other recurrences against our Gated DeltaNet, and
Gated DeltaNet-2 against jax-linear-attention's plain-JAX `gdn2` (`_impls.family`), at
Qwen3-Next-like heads (HV = 32 value heads, q and k with H = 16 heads where the recurrence
allows it, which is all of ours; jla gets them repeated to 32), T = 2048:

- `GDN`: `deltanet_cp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)`;
- `KDA`: `deltanet_cp.chunk_kda` (decays per key channel);
- `GDN-2`: `deltanet_cp.chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm=True)`;
- `DPLR`: `deltanet_cp.chunk_dplr_delta_rule(q, k, v, a, b, gk)`, RWKV-7-like inputs
  (`a = -kk`, `b = kk * sigmoid(.)`, `kk` unit vectors; `gk` per value head);
- `GLA`: `deltanet_cp.chunk_gla(q, k, v, g, use_qk_l2norm=True)`, a decay per key channel;
- `Mamba-2`: the same with a decay per head (Mamba-2 / SSD-like);
- `jla GDN-2`: jax-linear-attention 0.1.0's `jla.ops.chunked.gdn2`, the same inputs as
  ours (`--only GDN,GDN-2,DPLR,GLA,Mamba-2` runs without the bench environment);
- `precond GDN`, `precond KDA`: `deltanet_cp.chunk_precond_gated_delta_rule` and
  `deltanet_cp.chunk_precond_kda` (`use_qk_l2norm=True`; the preconditioner with `H` heads,
  its final state unused), two engine runs each.
- `Momentum`: `deltanet_cp.chunk_momentum_delta_rule(q, k, v, log_alpha, log_mu, p, beta,
  eta)` with flash-linear-attention's defaults (q, k, p L2-normalised, the probe times
  alpha); its state `[S; M]` has 2K rows, so the cotangent of the final state is twice
  GDN's.

    python benchmarks/peers.py            # both shapes, about 4 minutes on 2 quiet cores
    python benchmarks/peers.py --quick    # tiny shapes, a smoke test (under a minute)
    python benchmarks/peers.py --family   # about 5 minutes on 2 quiet cores
"""

import argparse
import json
import os
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine_line, print_table  # noqa: E402
from _harness import Impl, max_rel_diff, Session  # noqa: E402


IMPLS = {
    "ours": Impl("ours", "_impls:ours"),
    "ours high": Impl("ours high", "_impls:ours", {"memory": "high"}),
    "MaxText": Impl("MaxText", "_impls:maxtext"),
    "jla": Impl("jla", "_impls:jla"),
    "transformers": Impl("transformers", "_impls:transformers"),
}
PASSES = ["fwd", "fwd+bwd"]
# (label, B, T, H, HV, K = V, paired rounds)
SHAPES = [
    ("Qwen3-Next heads: H=16, HV=32, T=2048", 1, 2048, 16, 32, 128, 5),
    ("H=HV=4, T=4096", 1, 4096, 4, 4, 128, 7),
]
QUICK = [
    ("tiny: H=2, HV=4, K=V=32, T=256", 1, 256, 2, 4, 32, 3),
    ("tiny: H=HV=2, K=V=32, T=512", 1, 512, 2, 2, 32, 3),
]
FAMILY = {
    "GDN": Impl("GDN", "_impls:family", {"kind": "gdn"}),
    "KDA": Impl("KDA", "_impls:family", {"kind": "kda"}),
    "GDN-2": Impl("GDN-2", "_impls:family", {"kind": "gdn2"}),
    "DPLR": Impl("DPLR", "_impls:family", {"kind": "dplr"}),
    "GLA": Impl("GLA", "_impls:family", {"kind": "gla"}),
    "Mamba-2": Impl("Mamba-2", "_impls:family", {"kind": "mamba2"}),
    "jla GDN-2": Impl("jla GDN-2", "_impls:family", {"kind": "jla_gdn2"}),
    "precond GDN": Impl("precond GDN", "_impls:family", {"kind": "precond_gdn"}),
    "precond KDA": Impl("precond KDA", "_impls:family", {"kind": "precond_kda"}),
    "Momentum": Impl("Momentum", "_impls:family", {"kind": "momentum"}),
}
FAMILY_SHAPES = [("Qwen3-Next-like heads: H=16, HV=32, T=2048", 1, 2048, 16, 32, 128, 5)]
FAMILY_QUICK = [("tiny: H=2, HV=4, K=V=32, T=256", 1, 256, 2, 4, 32, 3)]
# Whose outputs each implementation's are compared with (the same function of the inputs).
SAME = {"MaxText": "ours", "jla": "ours", "transformers": "ours", "jla GDN-2": "GDN-2"}
CHUNK = 64
SQUARES = (2048, 4096)  # the yardstick's square products, n x n times n x n
SQUARES_QUICK = (512, 1024)
BACKENDS = {"xla": "XLA", "numpy": "BLAS"}


def square_rates(sizes, deadline: float) -> dict:
    """The machine's float32 matmul rate on square products of `sizes`, per backend (`xla`,
    `numpy`), each measured in a fresh process (`_impls.square_rates`): `{backend: {"what":
    ..., "rates": {str(n): FLOP/s}}}`, a backend missing if its process failed or the run's
    budget is spent."""
    out = {}
    for backend in BACKENDS:
        left = deadline - time.monotonic()
        if left < 30:
            print(f"  {backend} squares: skipped, the run's budget is spent")
            continue
        code = (
            "import json, _impls; "
            f"print(json.dumps(_impls.square_rates({backend!r}, {list(sizes)!r})))"
        )
        try:
            run = subprocess.run(
                [sys.executable, "-c", code],
                cwd=HERE,
                capture_output=True,
                text=True,
                timeout=max(left, 30),
            )
        except subprocess.TimeoutExpired:
            print(f"  {backend} squares: timeout")
            continue
        if run.returncode:
            print(f"  {backend} squares failed: {run.stderr.strip().splitlines()[-1:]}")
            continue
        out[backend] = json.loads(run.stdout.strip().splitlines()[-1])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke test")
    parser.add_argument("--family", action="store_true", help="our other recurrences")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds per shape")
    parser.add_argument("--calls", type=int, default=None, help="calls per pass per round")
    parser.add_argument("--only", default=None, help="comma-separated implementations")
    parser.add_argument("--shapes", default=None, help="comma-separated shape indices")
    parser.add_argument("--budget", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--hang-after", type=float, default=30, help="seconds without CPU time")
    parser.add_argument("--retries", type=int, default=1, help="restarts of a hung worker")
    parser.add_argument(
        "--squares", default=None, help="comma-separated sizes n of the yardstick's n x n products"
    )
    args = parser.parse_args()

    impls = FAMILY if args.family else IMPLS
    names = args.only.split(",") if args.only else list(impls)
    base = "GDN" if args.family else "ours"
    if names[0] != base and base in names:
        names.remove(base)
        names.insert(0, base)
    if args.family:
        shapes = FAMILY_QUICK if args.quick else FAMILY_SHAPES
    else:
        shapes = QUICK if args.quick else SHAPES
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    calls = args.calls or (3 if args.quick else 1)
    start = time.monotonic()
    print(
        f"float32, chunk {CHUNK}, q/k L2 norm, final state; one process per implementation, "
        f"stopped while another is timed; a worker without CPU progress for "
        f"{args.hang_after:.0f} s is a hang"
    )
    print(f"machine before: {machine_line()}", flush=True)
    cores = len(os.sched_getaffinity(0))
    if os.getloadavg()[0] > cores / 2:
        print(
            "warning: the machine is busy; under load an implementation using several threads "
            "(PyTorch, LAPACK) loses more than one that does not, so ratios flatter the latter"
        )

    results = []
    with Session(
        [impls[n] for n in names],
        hang_after=args.hang_after,
        deadline=start + args.budget,
        retries=args.retries,
    ) as session:
        for label, b, t, h, hv, d, rounds in shapes:
            print(f"{label}:", flush=True)
            session.prepare(b=b, t=t, h=h, hv=hv, d=d, chunk=CHUNK, passes=PASSES)
            res = session.time(PASSES, rounds=args.rounds or rounds, calls=calls)
            results.append((label, res))
            loads = [x for n in names for x in res.outcomes[n].loads if x is not None]
            during = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
            print(f"  done; load average during the rounds {during}; {machine_line()}")

    sizes = [int(n) for n in args.squares.split(",")] if args.squares else None
    sizes = sizes or (SQUARES_QUICK if args.quick else SQUARES)
    print(f"square products {', '.join(f'{n}x{n}' for n in sizes)}:", flush=True)
    squares = square_rates(sizes, start + args.budget)
    print(f"  done; {machine_line()}")
    # Per backend, the best rate over the sizes: what a large product reaches here.
    peak = {b: max(squares[b]["rates"].values()) for b in squares}

    info = {}
    for _, res in results:
        for n in names:
            info.setdefault(n, res.outcomes[n].info)
    versions = ", ".join(
        f"{n} {info[n].get('version', '?')}" for n in names if info.get(n, {}).get("version")
    )
    jax_version = next((i["jax"] for i in info.values() if "jax" in i), "?")
    torch_version = next((i["torch"] for i in info.values() if "torch" in i), None)
    print(f"\njax {jax_version}" + (f", torch {torch_version}" if torch_version else ""))
    print(f"versions: {versions}")

    peers = names[1:]
    compared = [n for n in peers if SAME.get(n) in names]
    res_t = {s[0]: s[2] for s in shapes}
    time_rows, ratio_rows, diff_rows, mem_rows, notes = [], [], [], [], []
    for label, res in results:
        for p in PASSES:
            row = [label, p] + [res.ms(n, p) for n in names]
            for peer in peers:
                r = res.ratio(peer, names[0], p)
                row.append(f"{r:.2f}x" if r is not None else "-")
            row.append(min((res.rounds(n, p) for n in names if res.rounds(n, p)), default=0))
            time_rows.append(row)
        ratio_rows.append(
            [label]
            + [
                f"{r:.2f}" if (r := res.ratio(n, n, "fwd+bwd", "fwd")) is not None else "-"
                for n in names
            ]
        )
        cells = []
        for peer in compared:
            ref, out = res.outputs.get(SAME[peer]), res.outputs.get(peer)
            if ref is None or out is None:
                cells += [res.why_missing(peer, "fwd")] * 2
            else:
                cells += [f"{max_rel_diff(out[k], ref[k]):.1e}" for k in ("o", "h")]
        diff_rows.append([label] + cells)
        for n in names:
            i = res.outcomes[n].info
            mem_rows.append(
                [label, n]
                + [
                    f"{i[f'temp_bytes {p}'] / res_t[label] / 1024:.1f}"
                    if f"temp_bytes {p}" in i
                    else "-"
                    for p in PASSES
                ]
            )
        notes += [f"{label}, {n}" for n in res.notes()]

    print_table(
        ["shape (B=1, float32)", "pass"]
        + [f"{n} ms" for n in names]
        + [f"{names[0]} vs {p}" for p in peers]
        + ["rounds"],
        time_rows,
        title=f"Medians over paired rounds, one process per implementation; {names[0]} vs X = "
        f"median of per-round X / {names[0]} times (> 1: {names[0]} faster)",
    )
    print_table(
        ["shape"] + names,
        ratio_rows,
        title="Forward+backward / forward, each implementation in its own process (median of "
        "per-round ratios)",
    )
    rate_rows = []
    for label, res in results:
        for n in names:
            i = res.outcomes[n].info
            for p in PASSES:
                flops, sec, rate = (
                    i.get(f"matmul_flops {p}"),
                    res.median(n, p),
                    i.get("matmul_rate"),
                )
                if flops is None or sec is None or rate is None:
                    continue
                achieved = flops / sec
                rate_rows.append(
                    [label, n, p, f"{flops / 1e9:.2f}", f"{sec * 1e3:.0f}", f"{achieved / 1e9:.1f}"]
                    + [f"{rate / 1e9:.1f}", f"{achieved / rate:.0%}"]
                    + [f"{achieved / peak[b]:.0%}" if b in peak else "-" for b in BACKENDS]
                )
    print_table(
        ["square product", *(BACKENDS[b] + " GFLOP/s" for b in BACKENDS)],
        [
            [f"{n} x {n}"]
            + [
                f"{squares[b]['rates'][str(n)] / 1e9:.1f}" if b in squares else "-"
                for b in BACKENDS
            ]
            for n in sizes
        ],
        title="The yardstick: this CPU's float32 matmul rate on large square products, the "
        "best of 3 calls, each backend in a process of its own after the implementations ("
        + "; ".join(f"{BACKENDS[b]}: {squares[b]['what']}" for b in squares)
        + ")",
    )
    print_table(
        ["shape", "implementation", "pass", "matmul GFLOP", "ms", "GFLOP/s"]
        + ["machine's matmul GFLOP/s", "of the machine's rate"]
        + [f"of {BACKENDS[b]}'s square rate" for b in BACKENDS],
        rate_rows,
        title="Matmul work and the rate achieved (JAX implementations; the machine's rate: "
        "batched float32 (64, K) x (K, K) products, HIGHEST, in the same worker; the square "
        "rates: the best of the yardstick's sizes per backend)",
    )
    if compared:
        print_table(
            ["shape"] + [f"{x}: {p} vs {SAME[p]}" for p in compared for x in ("o", "h_T")],
            diff_rows,
            title="Largest relative difference of the outputs (max |x - y| / max |y|)",
        )
    print_table(
        ["shape", "implementation", "fwd KiB/token", "fwd+bwd KiB/token"],
        mem_rows,
        title="Compiled temporaries (memory_analysis().temp_size_in_bytes / T)",
    )
    if notes:
        print("\n* " + "\n* ".join(notes))
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

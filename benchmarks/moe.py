"""The sparse mixture-of-experts layer: ours vs the ragged_dot design vs a dense-masked MoE vs
transformers, on this CPU, paired.

Qwen3-Next's MoE block on one sequence, float32: `E = 64` experts, top-4 (renormalised),
hidden `H = 512`, expert width `I = 256`, a shared expert of width 512, `T = 2048` tokens;
forward, and forward+backward (the pullback of a fixed random cotangent of the output to
every weight and to `x`). Four implementations (`_moe_impls.py`), the same weights:

- ours: `deltanet_cp.nn.SparseMoE` (its public constructor and call);
- ragged_dot: the sort-by-expert + `jax.lax.ragged_dot_general` design, copied into the
  benchmark (on XLA:CPU, `ragged_dot` lowers to a dense product masked per group: every
  expert over all `T k` sorted rows, `E` times the routed FLOPs);
- dense: every expert on every token, the routing weights zero off the top-k (`E / k`
  times the routed FLOPs);
- transformers: `Qwen3NextSparseMoeBlock`, eager PyTorch (its loop over the experts hit).

Each runs in its own process, stopped while another is timed; a round times each once,
the order rotating; a ratio is the median over rounds of the per-round ratio
(`_harness.py`). The transformers worker runs under `--torch-python` (an interpreter with
torch and transformers; the driver's by default, as in `make bench`).

Prints: medians (ms) and ours vs each; the matmul FLOPs of each JAX implementation's
compiled program (every `dot`, loop bodies times their trips) and, for the routed experts
alone (the total minus the router, the shared expert and its gate, counted analytically:
`2 T H (E + 3 S + 1)` forward, three times that forward+backward), their ratio to the
routed (active) count `2 * 3 T k H I` (three times that forward+backward). Our routed
experts are a loop over tiles of one expert's pairs whose trip count depends on the routing
(the compiled program holds the body once): their FLOPs are the tiles run, counted from the
routing, times a tile's products. The largest
relative difference of each implementation's output from ours; the compiled temporaries
per token.

Then, if `SparseMoE.__call__` takes `expert_axis=` (expert parallelism), ours with its
experts split over 2 and 4 of 8 simulated devices (`XLA_FLAGS`; tokens split too, inside
`shard_map`), beside ours on one device: time (paired, the simulated devices sharing the
cores: total work, not a multi-host step), matmul FLOPs per device, temporaries per token,
and the bytes the busiest rank receives per layer, read from the compiled HLO's
collectives. Without it, one line says so.

    python benchmarks/moe.py                  # the default shape (a few minutes)
    python benchmarks/moe.py --quick          # tiny shapes, a smoke test
    python benchmarks/moe.py --torch-python /path/to/venv/bin/python
"""

import argparse
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine_line, print_table  # noqa: E402
from _harness import Impl, max_rel_diff, Session  # noqa: E402
from _moe_impls import dense_part_flops, routed_active_flops  # noqa: E402


PASSES = ["fwd", "fwd+bwd"]
# The case: tokens, hidden, experts, top-k, expert width, shared expert width; rounds.
FULL = dict(t=2048, h=512, e=64, k=4, i=256, s=512)
QUICK = dict(t=128, h=64, e=8, k=2, i=32, s=64)
ROUNDS = {"full": 5, "quick": 3}
EP_SPLITS = (2, 4)
EP_DEVICES = 8


def label(case: dict) -> str:
    active = routed_active_flops(**pick(case, "t h i k"))
    return (
        "T={t}, H={h}, E={e}, top-{k}, I={i}, shared I={s}, float32".format(**case)
        + f"; routed active = 2*3*T*k*H*I = {active / 1e9:.3g} GFLOP forward"
    )


def pick(case: dict, names: str) -> dict:
    return {n: case[n] for n in names.split()}


def flops_cells(info: dict, case: dict, p: str) -> list[str]:
    """Matmul GFLOP, routed-expert GFLOP and their ratio to the active count, for pass `p`."""
    flops = info.get(f"matmul_flops {p}")
    if flops is None:
        return ["-", "-", "-"]
    passes = 1 if p == "fwd" else 3  # a product's backward is two products of its size
    dense = passes * dense_part_flops(**pick(case, "t h e s"))
    routed = flops - dense
    if f"routed_flops {p}" in info:  # ours: a loop of data-dependent trips, counted apart
        routed = info[f"routed_flops {p}"]
        flops = dense / info.get("split", 1) + routed
    active = passes * routed_active_flops(**pick(case, "t h i k"))
    return [f"{flops / 1e9:.2f}", f"{routed / 1e9:.2f}", f"{routed / active:.2f}"]


def kib_per_token(info: dict, p: str, t: int) -> str:
    b = info.get(f"temp_bytes {p}")
    return f"{b / t / 1024:.1f}" if b is not None else "-"


def main_table(args, case: dict, rounds: int, calls: int, start: float) -> None:
    impls = [
        Impl("ours", "_moe_impls:ours"),
        Impl("ragged_dot", "_moe_impls:ragged_dot"),
        Impl("dense", "_moe_impls:dense"),
        Impl("transformers", "_moe_impls:transformers", python=args.torch_python),
    ]
    names = [i.name for i in impls if not args.only or i.name in args.only.split(",")]
    impls = [i for i in impls if i.name in names]
    with Session(
        impls, hang_after=args.hang_after, deadline=start + args.budget, retries=1
    ) as session:
        session.prepare(**case)
        res = session.time(PASSES, rounds=rounds, calls=calls)
    base = names[0]
    time_rows = []
    for p in PASSES:
        row = [p] + [res.ms(n, p) for n in names]
        for n in names[1:]:
            r = res.ratio(n, base, p)
            row.append(f"{r:.2f}x" if r is not None else "-")
        row.append(min((res.rounds(n, p) for n in names if res.rounds(n, p)), default=0))
        time_rows.append(row)
    print_table(
        ["pass"] + [f"{n} ms" for n in names] + [f"{base} vs {n}" for n in names[1:]] + ["rounds"],
        time_rows,
        title=f"Medians over paired rounds, one process per implementation; {base} vs X = "
        f"median of per-round X / {base} times (> 1: {base} faster)",
    )
    flop_rows, mem_rows, diff_cells = [], [], []
    for n in names:
        info = res.outcomes[n].info
        for p in PASSES:
            if f"matmul_flops {p}" in info:
                flop_rows.append([n, p] + flops_cells(info, case, p))
        mem_rows.append([n] + [kib_per_token(info, p, case["t"]) for p in PASSES])
        ref, out = res.outputs.get(base), res.outputs.get(n)
        if n != base:
            ok = ref is not None and out is not None
            diff_cells.append(f"{max_rel_diff(out['y'], ref['y']):.1e}" if ok else "-")
    print_table(
        ["implementation", "pass", "matmul GFLOP", "routed experts GFLOP", "routed / active"],
        flop_rows,
        title="Matmul FLOPs of the compiled programs (every dot, loops x trips); the routed "
        "experts' = the total minus the router, shared expert and its gate (analytic)",
    )
    if diff_cells:
        print_table(
            [f"{n} vs {base}" for n in names[1:]],
            [diff_cells],
            title="Largest relative difference of the output y (max |y - y_ours| / max |y_ours|)",
        )
    print_table(
        ["implementation", "fwd KiB/token", "fwd+bwd KiB/token"],
        mem_rows,
        title="Compiled temporaries (memory_analysis().temp_size_in_bytes / T; none for torch)",
    )
    versions = ", ".join(
        f"{n} {res.outcomes[n].info.get('version', '?')}" for n in names if res.outcomes[n].info
    )
    print(f"\nversions: {versions}")
    for n in names:
        i = res.outcomes[n].info
        if "torch" in i:
            print(f"{n}: torch {i['torch']}, {i.get('threads')} threads")
    if res.notes():
        print("\n* " + "\n* ".join(res.notes()))


def has_expert_axis() -> bool:
    import inspect

    from _impls import import_ours

    import_ours()
    from deltanet_cp.nn import SparseMoE

    return "expert_axis" in inspect.signature(SparseMoE.__call__).parameters


def ep_table(args, case: dict, rounds: int, calls: int, start: float) -> None:
    if not has_expert_axis():
        print(
            "\nExpert parallelism: skipped (SparseMoE.__call__ has no `expert_axis` parameter "
            "in this checkout)"
        )
        return
    flags = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={EP_DEVICES}"
    )
    env = {"XLA_FLAGS": flags.strip()}
    impls = [Impl("ours, 1 device", "_moe_impls:ours")] + [
        Impl(f"ours, {n} expert ranks", "_moe_impls:ours_ep", {"split": n}, env=env)
        for n in EP_SPLITS
    ]
    names = [i.name for i in impls]
    with Session(
        impls, hang_after=args.hang_after, deadline=start + args.budget, retries=1
    ) as session:
        session.prepare(**case)
        res = session.time(PASSES, rounds=rounds, calls=calls)
    rows = []
    for n in names:
        info = res.outcomes[n].info
        split = info.get("split", 1)
        for p in PASSES:
            r = res.ratio(n, names[0], p)
            received = info.get(f"received {p}", 0)
            rows.append(
                [n, p, res.ms(n, p), f"{r:.2f}" if r is not None else "-"]
                + [flops_cells(info, case, p)[0], kib_per_token(info, p, case["t"] // split)]
                + [f"{received / 2**20:.2f}", info.get(f"collectives {p}", 0)]
            )
    print_table(
        ["implementation", "pass", "ms", "time / 1 device", "matmul GFLOP per device"]
        + ["temp KiB per local token", "MiB received per rank", "collectives"],
        rows,
        title=f"Expert parallelism on {EP_DEVICES} simulated devices (the experts and the tokens "
        "split over the expert axis; time is the total work of ranks sharing the cores); "
        "bytes received per rank per layer from the compiled HLO",
    )
    if res.notes():
        print("\n* " + "\n* ".join(res.notes()))


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds")
    parser.add_argument("--calls", type=int, default=None, help="calls per pass per round")
    parser.add_argument("--only", default=None, help="comma-separated implementations")
    parser.add_argument(
        "--torch-python", default=None, help="the interpreter of the transformers worker"
    )
    parser.add_argument("--no-ep", action="store_true", help="skip the expert-parallel table")
    parser.add_argument("--budget", type=float, default=1200, help="seconds for the whole run")
    parser.add_argument("--hang-after", type=float, default=60, help="seconds without CPU time")
    args = parser.parse_args()
    case = QUICK if args.quick else FULL
    rounds = args.rounds or ROUNDS["quick" if args.quick else "full"]
    calls = args.calls or (3 if args.quick else 1)
    start = time.monotonic()
    print(f"{label(case)}; one process per implementation, stopped while another is timed")
    print(f"machine before: {machine_line()}", flush=True)
    main_table(args, case, rounds, calls, start)
    if not args.no_ep:
        ep_table(args, case, rounds, calls, start)
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Causal softmax attention under context parallelism: work and memory per rank, by layout.

Compiles the blockwise causal attention of `deltanet_cp.nn.CausalSelfAttention` (the part
after the projections and RoPE: queries, keys and values in, output out) inside
`shard_map` over `cp` simulated CPU devices, for both layouts (`Contiguous`, `Zigzag`) and
both key/value exchanges (`allgather`, `ring`), and reads XLA's own accounting from the
compiled per-rank module. Nothing is executed.

- FLOPs per rank, forward: `cost_analysis()["flops"]`, corrected for loops, divided by the
  causal ideal per rank: `4 * head_dim * heads * S (S + 1) / 2 / cp` (the `q k^T` and
  `p v` matmuls of the `S (S + 1) / 2` visible (query, key) pairs, shared equally).
  A ratio of 1 is perfect balance with no wasted tile; the step time follows the busiest
  rank, so that is the one reported (with the least busy one beside it).
  Beside it, the same ratio counted from the tile schedule alone (`busiest_rank_work` in
  `_attention_schedule.py`: the busiest rank's tiles times `block_size^2` over the causal
  ideal in (query, key) pairs); the FLOP ratio is a few percent above it, XLA counting
  the tiles' elementwise work (the online softmax) too, which the ideal leaves out.
- The same for forward + backward, against 3.5 times the ideal (the backward's five
  matmuls per tile: the recomputed scores, `dp`, `dq`, `dk`, `dv`).
- Temporary memory per rank, `memory_analysis().temp_size_in_bytes`, forward and
  forward + backward, in KiB and KiB per local token.

The loop correction. XLA's cost analysis counts the body of a `while` loop once, whatever
its trip count, and so a loop nested in another once in all. The loops of these programs
are the kernel's loops over tiles and, for the ring, its loop over steps `1 .. cp - 1`,
whose body is one ring step: a `ppermute` of the step's keys and values (and, in the
backward, of their gradients' accumulators), a look-up in the static tables, and a loop
over the step's tiles. So the all-gather's forward has one loop over tiles, run once; the
ring's has two, the local diagonal's (run once) and the step's (run `cp - 1` times, nested
in the loop over steps); the backward adds one per forward loop, nested alike. All of
them run the same body: one tile of `block_size` queries by `block_size` keys (the
backward's loops, one tile of the backward). The online softmax carries across the ring's
steps (no per-step merge), so a step's work outside its loop over tiles is scalar index
arithmetic. So the true count of a program is

    raw + sum over its forward loops over tiles of (trips - 1) * body

with `body` the flops of one tile step, forward (or forward + backward, for the gradient
program, each backward loop having the trips of its forward loop), and

- `trips`, exact, the tiles a loop runs in the whole program, per rank, counted from the
  layout and causality (`schedules` in `_attention_schedule.py`: the tiles holding at least
  one visible (query, key) pair, which are the tiles the kernel computes): for the ring's
  nested loop, the tiles of each step summed over the `cp - 1` trips of the loop over
  steps;
- `body`, measured in place: the same per-rank program compiled with its loops over tiles
  running two tiles per trip (`unrolled(2)` of `_attention_schedule.py`, which puts a
  second copy of the body in each; the loop over steps stays rolled; every zigzag tile
  count per run is even here) counts `n_loops` bodies more than the rolled one, so
  `body = (raw(unroll=2) - raw) / n_loops`. Contiguous programs have rank-dependent
  trip counts (no unrolling) but the same loop body: they take the zigzag program's body
  at the same `S`, `cp` and exchange.

Checks (printed): at S = 4096, cp = 4, the program compiled with four tiles per trip
(`unroll=4`; every trip count there is a multiple of 4) has XLA count
`raw + 3 * n_loops * body`, to within the loop counters' scalar flops (~1e-7); and at
S = 1024 the corrected count of the rolled program (with the body measured at S = 4096)
against the program compiled with no loop at all (every loop, the ring's loop over steps
included, unrolled; CSE off). The
latter differ by a few tenths of a percent: XLA fuses straight-line code differently from
a loop body, and counts elementwise operations duplicated into several fusions more than
once.

    python benchmarks/attention_balance.py           # S = 4096, 16384; cp = 4, 8
    python benchmarks/attention_balance.py --quick   # S = 4096; cp = 4
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import argparse  # noqa: E402
import functools as ft  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _attention_schedule import (  # noqa: E402
    blockwise_attention,
    busiest_rank_work,
    schedules as tile_schedules,
    unrolled,
)
from _common import print_table  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402


HEADS, HEAD_DIM, BLOCK = 4, 64, 128
LAYOUTS = {"Contiguous": dcp.Contiguous(), "Zigzag": dcp.Zigzag()}
EXCHANGES = ("allgather", "ring")


def raw_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def temp_bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    return memory.temp_size_in_bytes


@ft.cache
def compile_rank(
    s: int, cp: int, layout, exchange: str, *, grad: bool, unroll=False, no_cse: bool = False
):
    """The per-rank program of one attention over `s` tokens, compiled (not run)."""
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P("cp")
    context = dcp.ContextParallel("cp", layout=layout)

    def attend(q, k, v):
        pos = layout.positions(q.shape[0], "cp")
        return blockwise_attention(q, k, v, pos, cp=context, kv_schedule=exchange, tile_size=BLOCK)[
            0
        ]

    if grad:

        def per_rank(q, k, v):
            return jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2))(q, k, v)

        out_specs = (seq, seq, seq)
    else:
        per_rank, out_specs = attend, seq
    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,) * 3, out_specs=out_specs))
    arg = jax.ShapeDtypeStruct((s, HEADS, HEAD_DIM), jnp.float32, sharding=NamedSharding(mesh, seq))
    with unrolled(unroll, schedules(s, cp, layout, exchange)):
        lowered = fn.lower(arg, arg, arg)
    if no_cse:
        return lowered.compile(compiler_options={"xla_disable_hlo_passes": "cse"})
    return lowered.compile()


def schedules(s: int, cp: int, layout, exchange: str):
    """The forward's loops over tiles, each as its runs' tiles per rank."""
    return tile_schedules(s, cp, layout, exchange, BLOCK)[1]


def trips(s: int, cp: int, layout, exchange: str) -> list[list[int]]:
    """Per rank, the trip counts of the forward's loops over tiles in the whole program
    (the static tile schedule): a loop run once per ring step counts the tiles of all its
    runs (the trips of the loop over steps times the tiles per step, where those are the
    same at every step)."""
    loops = schedules(s, cp, layout, exchange)
    return [[sum(run[r] for run in loop) for loop in loops] for r in range(cp)]


def tiles_per_run(s: int, cp: int, layout, exchange: str) -> list[int]:
    """Rank 0's tile count in each run of each forward loop (for the unrolled programs,
    which need every one to be a multiple of the tiles per trip)."""
    return [run[0] for loop in schedules(s, cp, layout, exchange) for run in loop]


def corrected(raw: float, loop_trips: list[int], body: float) -> float:
    return raw + sum(n - 1 for n in loop_trips) * body


def ideal(s: int, cp: int) -> float:
    return 4 * HEAD_DIM * HEADS * s * (s + 1) / 2 / cp


def zigzag_body(s: int, cp: int, exchange: str, grad: bool, rolled) -> float:
    """The flops of one tile step in place: the program at two tiles per trip, minus it."""
    loop_trips = trips(s, cp, dcp.Zigzag(), exchange)[0]
    runs = tiles_per_run(s, cp, dcp.Zigzag(), exchange)
    assert all(n % 2 == 0 for n in runs), runs
    twice = compile_rank(s, cp, dcp.Zigzag(), exchange, grad=grad, unroll=2)
    return (raw_flops(twice) - raw_flops(rolled)) / len(loop_trips)


def check_calibration() -> None:
    s, cp, layout = 32 * BLOCK, 4, dcp.Zigzag()  # 4 tiles per zigzag piece
    small = 8 * BLOCK  # 1 tile per zigzag piece
    rows = []
    for exchange in EXCHANGES:
        loop_trips = trips(s, cp, layout, exchange)[0]
        runs = tiles_per_run(s, cp, layout, exchange)
        assert all(n % 4 == 0 for n in runs), runs
        for grad in (False, True):
            rolled = compile_rank(s, cp, layout, exchange, grad=grad)
            body = zigzag_body(s, cp, exchange, grad, rolled)
            raw = raw_flops(rolled)
            predicted = raw + 3 * len(loop_trips) * body
            four = raw_flops(compile_rank(s, cp, layout, exchange, grad=grad, unroll=4))
            # The same body, at a smaller size, against the program with no loop at all.
            fixed = corrected(
                raw_flops(compile_rank(small, cp, layout, exchange, grad=grad)),
                trips(small, cp, layout, exchange)[0],
                body,
            )
            full = raw_flops(
                compile_rank(small, cp, layout, exchange, grad=grad, unroll=True, no_cse=True)
            )
            rows.append(
                [
                    exchange,
                    "fwd+bwd" if grad else "fwd",
                    f"{raw:.0f}",
                    f"{body:.0f}",
                    f"{predicted:.0f}",
                    f"{four:.0f}",
                    f"{(predicted - four) / four:+.1e}",
                    f"{fixed:.0f}",
                    f"{full:.0f}",
                    f"{(fixed - full) / full:+.1e}",
                ]
            )
    print_table(
        [
            "exchange",
            "pass",
            f"raw, S={s}",
            "body",
            "predicted, unroll=4",
            "XLA, unroll=4",
            "rel. diff",
            f"corrected, S={small}",
            "XLA, no loops",
            "rel. diff",
        ],
        rows,
        title=f"Calibration check (cp = {cp}, Zigzag; flops): the program at 4 tiles per loop "
        f"trip, predicted from the rolled one and the body; and the corrected count at S = "
        f"{small} against the program compiled with every loop unrolled (CSE off, so that "
        "the backward recomputes the scores as its loop does)",
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="S = 4096 and cp = 4 only")
    args = parser.parse_args()
    sizes = (4096,) if args.quick else (4096, 16384)
    cps = (4,) if args.quick else (4, 8)
    start = time.perf_counter()
    print(
        f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices; batch 1, "
        f"{HEADS} heads x {HEAD_DIM}, block {BLOCK}, float32"
    )
    check_calibration()
    rows = []
    for s in sizes:
        for cp in cps:
            for exchange in EXCHANGES:
                programs = {}
                for name, layout in LAYOUTS.items():
                    for grad in (False, True):
                        programs[name, grad] = compile_rank(s, cp, layout, exchange, grad=grad)
                body = {
                    grad: zigzag_body(s, cp, exchange, grad, programs["Zigzag", grad])
                    for grad in (False, True)
                }
                for name, layout in LAYOUTS.items():
                    per_rank_trips = trips(s, cp, layout, exchange)
                    fwd, fb = programs[name, False], programs[name, True]
                    f_ranks = [corrected(raw_flops(fwd), tr, body[False]) for tr in per_rank_trips]
                    fb_ranks = [corrected(raw_flops(fb), tr, body[True]) for tr in per_rank_trips]
                    t = s // cp
                    mem_f, mem_fb = temp_bytes(fwd), temp_bytes(fb)
                    rows.append(
                        [
                            s,
                            cp,
                            name,
                            exchange,
                            f"{max(f_ranks) / ideal(s, cp):.3f}",
                            f"{busiest_rank_work(BLOCK, s, cp, layout, exchange):.3f}",
                            f"{min(f_ranks) / ideal(s, cp):.3f}",
                            f"{max(fb_ranks) / (3.5 * ideal(s, cp)):.3f}",
                            f"{mem_f / 1024:,.0f}",
                            f"{mem_f / 1024 / t:.2f}",
                            f"{mem_fb / 1024:,.0f}",
                            f"{mem_fb / 1024 / t:.2f}",
                        ]
                    )
    print_table(
        [
            "S",
            "cp",
            "layout",
            "kv_schedule",
            "fwd FLOPs / ideal (busiest rank)",
            "(its tiles / ideal)",
            "(least busy rank)",
            "fwd+bwd FLOPs / 3.5 ideal (busiest)",
            "fwd temp KiB",
            "KiB / local token",
            "fwd+bwd temp KiB",
            "KiB / local token",
        ],
        rows,
        title="Per-rank causal attention work and memory (XLA cost and memory analysis of the "
        "compiled per-rank module, loop-corrected; ideal = 4 d h S(S+1)/2 / cp)",
    )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()

"""Shared pieces of the benchmark scripts: timing, flop counting, the matmul roofline."""

import os
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np


# `jax.jit(..., compiler_options=NO_YNN)`: this one compile without XLA:CPU's YNNPACK fusions.
NO_YNN = {"xla_cpu_experimental_ynn_fusion_type": ""}


def gdn_inputs(rng: np.random.Generator, b: int, t: int, h: int, hv: int, d: int) -> list:
    """float32 `q, k, v, g, beta` for the gated delta rule, `K = V = d`: normal queries, keys
    and values, `g = -softplus(normal)`, `beta = sigmoid(normal)`, drawn from `rng` in that order.
    """
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k = rng.standard_normal((b, t, h, d), dtype=np.float32)
    v = rng.standard_normal((b, t, hv, d), dtype=np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((b, t, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32)
    return [q, k, v, g, beta]


def median_time(fn: Callable, *args, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time in seconds of `fn(*args)` (already compiled), over `repeats` runs."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paired_times(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times of zero-argument `calls`, interleaved: round `i` runs every call once.

    The order rotates from round to round, so no call always follows the same neighbour;
    comparing two calls round by round (a paired ratio) cancels most of the drift of a
    machine shared with other work. Each call must block until its result is ready.
    """
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - start)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of `numerator[i] / denominator[i]`."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def compiled_flops(fn: Callable, *args) -> float:
    """XLA's `cost_analysis()` flop count for `jax.jit(fn)(*args)`."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(cost, list):
        cost = cost[0]
    return float(cost["flops"])


def loop_aware_flops(make_args: Callable[[int], tuple], fn: Callable, n1: int, n2: int, n: int):
    """Flops of `fn` at loop length `n`, correcting XLA's cost analysis for loops.

    XLA counts a `while` body once, not once per trip. The cost of a call whose loops all
    run over `m` items is `a * m + body` as XLA reports it, and `(a + body) * m` in truth;
    two compiles at `m = n1, n2` give `a` and `body`.

    **Arguments:**

    - `make_args`: `m -> args` for a problem whose loops have `m` trips.
    - `fn`: the function to count.
    - `n1`, `n2`: two small loop lengths to fit on.
    - `n`: the loop length to report for.
    """
    f1 = compiled_flops(fn, *make_args(n1))
    f2 = compiled_flops(fn, *make_args(n2))
    per_item = (f2 - f1) / (n2 - n1)
    body = f1 - per_item * n1
    return (per_item + body) * n


def gdn_chunk_flops(b: int, t: int, hv: int, dk: int, dv: int, c: int = 64) -> float:
    """Flops of one forward pass of the chunked gated delta rule, counted one way for all.

    The matmuls of the chunked (WY) algorithm as Hugging Face transformers'
    `torch_chunk_gated_delta_rule` performs them, per chunk and value head: `k_beta k^T`
    and `q k^T` (`4 C^2 K`), the unit-triangular solve for `[v_beta | k_beta e^G]`
    (`C^2 (K + V)`), and per chunk of the scan `w h`, `q h`, `attn v_new` and `k^T v_new`
    (`6 C K V + 2 C^2 V`). Elementwise work is not counted. Using the same count for every
    implementation makes GFLOP/s comparable and their ratio the speed ratio.
    """
    n = -(-t // c)
    per_chunk = 4 * c * c * dk + c * c * (dk + dv) + 6 * c * dk * dv + 2 * c * c * dv
    return float(b * hv * n * per_chunk)


def matmul_rate(size: int = 1024, dtype=jnp.float32) -> float:
    """This process's achieved float32 matmul rate in FLOP/s (the roofline we compare to)."""
    a = jr.normal(jr.key(0), (size, size), dtype)
    b = jr.normal(jr.key(1), (size, size), dtype)
    f = jax.jit(lambda a, b: a @ b)
    return 2 * size**3 / median_time(f, a, b, repeats=11)


def machine_line() -> str:
    """Cores visible to this process and the load average (how shared the machine is)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cores} cores, load average {load} (1, 5, 15 min)"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (all its threads) from /proc; None if unknown.

    A process whose CPU time stops advancing while it should be computing is deadlocked
    (jaxlib's CPU triangular solve can be, see `benchmarks/vs_maxtext.py`).
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """Print a plain Markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}\n")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")

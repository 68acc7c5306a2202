"""Shared pieces of the benchmark scripts: inputs, in-process pairing, the exchanges' cost
model, the machine, tables.

Nothing here imports jax or torch at module level, so every worker process can use it.
"""

import os
import statistics
import time
from collections.abc import Callable

import numpy as np


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


def paired_times(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times of zero-argument `calls`, interleaved: round `i` runs every call once.

    For variants of one implementation in one process (e.g. two layouts of ours); peers
    are compared through `_harness.py`, one process each. The order rotates from round to
    round, so no call always follows the same neighbour. Each call must block until its
    result is ready.
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


def payload_bytes(
    exchange,
    cp: int,
    *,
    map_elements: int,
    state_elements: int,
    final_state: bool = False,
    layout=None,
    itemsize: int = 4,
) -> int:
    """Bytes the busiest rank receives in one exchange of maps, by the exchange's own cost
    model (`payload_elements`): every benchmark reads the cost model through here.

    `map_elements` are one rank's map, e.g. `B HV K (K + V)` for a dense `AffineMap`,
    `state_elements` one state, `B HV K V`; `itemsize` 4 for float32 maps.
    """
    elements = exchange.payload_elements(
        cp,
        map_elements=map_elements,
        state_elements=state_elements,
        final_state=final_state,
        layout=layout,
    )
    return itemsize * elements


def machine_line() -> str:
    """Cores visible to this process and the load average (how shared the machine is)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cores} cores, load average {load} (1, 5, 15 min)"


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

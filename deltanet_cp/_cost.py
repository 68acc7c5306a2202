"""The arithmetic of the exchanges' cost model, below the exchanges that state their terms
(each built-in exchange its `received` and `rounds`, beside its collective)."""

import math


def log2(cp: int) -> int:
    """The rounds of a log-depth prefix over `cp` ranks: $\\lceil \\log_2 cp \\rceil$."""
    return math.ceil(math.log2(cp)) if cp > 1 else 0


def all_reduce(cp: int, state_elements: int, needed: bool) -> int:
    """Elements a rank receives in a bandwidth-optimal ring all-reduce of a state."""
    return (2 * (cp - 1) * state_elements) // cp if needed else 0

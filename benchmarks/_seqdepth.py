"""Sequential depth of a compiled program, counted from its optimized HLO text.

Every top-level op inside a `while` loop body runs once per trip, one trip after the other:
on a GPU or TPU each is roughly one kernel launch on the critical path. The sequential depth
is the number of such ops, each loop's body counted times its trip count (nested loops
multiplied). Divided by the tokens it is a backend-independent measure of how much of a
program is serialised; the ops outside every loop are what runs once, whatever the length.

Counted as XLA compiled the program: a fusion is one op; parameters, tuples, tuple
elements, constants, bitcasts and the like are not ops. A `call` counts its callee's ops and
a `conditional` its largest branch. Trip counts come from XLA's `known_trip_count` (else
the largest `s32` constant in the loop condition), read by `deltanet_cp.internal.loop_trips`.
The same count as `../shared/tools/seqdepth.py`, with the ops outside loops as well.

The matmul FLOPs (`matmul_flops`) count a `conditional` in a loop body with as many
branches as the loop has trips by the mean of its branches per trip: a `fori_loop` over a
`switch` on its index (the levels of `decayed_grams`' VJP) takes each branch once. Any other
`conditional` counts its largest branch.
"""

import dataclasses
import re

import deltanet_cp as dcp
from deltanet_cp._hlo import hlo_computations


_NOT_OPS = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "constant",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
}
_OPCODE = re.compile(r"^(?:ROOT )?%?[\w.\-]+ = .*? ([a-z][\w\-]*)\(")


@dataclasses.dataclass(frozen=True)
class Depth:
    """Ops of a compiled program, inside and outside its `while` loops.

    - `inside`: ops inside loops, each body counted times its trips (the sequential depth).
    - `outside`: ops outside every loop (run once per call).
    - `loops`: `(trips, ops per trip)` of each outermost loop, in program order.
    """

    inside: int
    outside: int
    loops: tuple[tuple[int, int], ...]

    def loops_text(self) -> str:
        """The loops as `trips x body` terms, e.g. `64 x 92 + 64 x 154`."""
        return " + ".join(f"{t} x {n}" for t, n in self.loops) or "no loops"


def _computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    computations, entry = hlo_computations(hlo)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _trips(line: str, trips: dict[str, int | None]) -> int:
    """The trips of the `while` on `line`, from `deltanet_cp.internal.loop_trips`; 1 where
    the module does not give them."""
    name = line.removeprefix("ROOT ").split("=", 1)[0].strip().lstrip("%")
    n = trips.get(name)
    return 1 if n is None else n


def _count(computations, trips, name, loops) -> tuple[int, int]:
    """`(inside, outside)` ops of computation `name`; appends its outermost loops."""
    inside = outside = 0
    for line in computations.get(name, []):
        m = _OPCODE.match(line)
        op = m.group(1) if m else None
        if op is None or op in _NOT_OPS:
            continue
        if op == "while":
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            n = _trips(line, trips)
            body_inside, body_outside = _count(computations, trips, body, [])
            per_trip = body_inside + body_outside
            loops.append((n, per_trip))
            inside += n * per_trip
            continue
        if op in ("call", "conditional"):
            callees = re.findall(
                r"(?:to_apply|true_computation|false_computation)=%?([\w.\-]+)", line
            )
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                callees += re.findall(r"%?([\w.\-]+)", branches.group(1))
            counts = [_count(computations, trips, c, loops) for c in callees]
            if counts:
                best = max(counts, key=lambda c: (c[0] + c[1], c[0]))
                inside += best[0]
                outside += best[1]
            else:
                outside += 1
            continue
        outside += 1
    return inside, outside


def hlo_depth(hlo: str) -> Depth:
    """The `Depth` of a compiled module's HLO text (`compiled.as_text()`)."""
    computations, entry = _computations(hlo)
    loops: list[tuple[int, int]] = []
    inside, outside = _count(computations, dcp.internal.loop_trips(hlo), entry, loops)
    return Depth(inside, outside, tuple(loops))


def depth(compiled) -> Depth:
    """The `Depth` of a compiled JAX function (`jax.jit(f).lower(*args).compile()`)."""
    return hlo_depth(compiled.as_text())


# ------------------------------------------------------------------ matmul FLOPs

_SHAPE = re.compile(r"\b[a-z]\w*\[([\d,]*)\]")
_DEF = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (\w+\[[\d,]*\])")


def _shape(text: str) -> list[int]:
    m = _SHAPE.search(text)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def _dot(line: str, shapes: dict[str, list[int]]) -> float:
    """2 x output elements x contracted elements of one `dot` line."""
    out = _shape(line.split("=", 1)[1])
    operands = re.search(r"\bdot\(([^)]*)\)", line).group(1).split(",")
    lhs_text = operands[0].strip()
    lhs = _shape(lhs_text) if "[" in lhs_text else shapes.get(lhs_text.lstrip("%"), [])
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    contracted = 1
    for i in contracting.group(1).split(",") if contracting and contracting.group(1) else []:
        contracted *= lhs[int(i)]
    n = 1
    for d in out:
        n *= d
    return 2.0 * n * contracted


def _flops(
    computations, trips, name, memo, trips_here: int = 1, unknown: int | None = None
) -> float:
    """Matmul FLOPs of one computation, run `trips_here` times by the loop it is the body of
    (1 outside loops): a `conditional` with that many branches takes each branch once (a
    `fori_loop` over a `switch` on its index, as `decayed_grams`' VJP walks its levels), so
    it counts the mean of its branches per trip; any other its largest branch."""
    key = (name, trips_here)
    if key in memo:
        return memo[key]
    shapes = {}
    for line in computations.get(name, []):
        m = _DEF.match(line)
        if m:
            shapes[m.group(1)] = _shape(m.group(2))
    total = 0.0
    for line in computations.get(name, []):
        m = _OPCODE.match(line)
        op = m.group(1) if m else None
        if op == "dot":
            total += _dot(line, shapes)
        elif op == "while":
            body = re.search(r"body=%?([\w.\-]+)", line).group(1)
            n = _trips(line, trips)
            if unknown is not None and '"known_trip_count"' not in line:
                n = unknown
            total += n * _flops(computations, trips, body, memo, n, unknown)
        else:
            for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                total += _flops(computations, trips, callee, memo, trips_here, unknown)
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                names = re.findall(r"%?([\w.\-]+)", branches.group(1))
                counts = [_flops(computations, trips, b, memo, 1, unknown) for b in names]
                if len(names) == trips_here > 1:
                    total += sum(counts) / len(counts)
                else:
                    total += max(counts, default=0.0)
    memo[key] = total
    return total


def hlo_matmul_flops(hlo: str, unknown_trips: int | None = None) -> float:
    """Matmul FLOPs of a compiled module's HLO text: every `dot` (inside fusions and called
    computations too) as 2 x output elements x contracted elements, a `while` body times
    its trips (XLA's own `cost_analysis` counts a loop body once). With `unknown_trips`, a
    loop whose trip count XLA does not know (a bound computed at run time, such as the
    number of tiles packed documents leave) runs that many trips."""
    computations, entry = _computations(hlo)
    return _flops(computations, dcp.internal.loop_trips(hlo), entry, {}, 1, unknown_trips)


def matmul_flops(compiled, unknown_trips: int | None = None) -> float:
    """`hlo_matmul_flops` of a compiled JAX function."""
    return hlo_matmul_flops(compiled.as_text(), unknown_trips)


@dataclasses.dataclass(frozen=True)
class LoopFlops:
    """Matmul FLOPs of a compiled module, with the loops whose trips XLA does not know apart.

    - `known`: every `dot` outside loops and in loops of known trips (times the trips).
    - `unknown`: per loop of unknown trips (a bound computed at run time: the tiles of a
        mixture of experts' routed pairs, of attention under context parallelism), `(body,
        times)`: one trip's FLOPs and how many times the loop itself runs (the trips of the
        known loops around it).
    """

    known: float
    unknown: tuple[tuple[float, int], ...]


def hlo_loop_flops(hlo: str) -> LoopFlops:
    """The `LoopFlops` of a compiled module's HLO text: `hlo_matmul_flops`' count, with each
    loop of unknown trips left to the caller (who knows what it loops over)."""
    computations, entry = _computations(hlo)
    trips = dcp.internal.loop_trips(hlo)
    unknown: list[tuple[float, int]] = []

    def count(name: str, times: int) -> float:
        shapes = {}
        for line in computations.get(name, []):
            m = _DEF.match(line)
            if m:
                shapes[m.group(1)] = _shape(m.group(2))
        total = 0.0
        for line in computations.get(name, []):
            m = _OPCODE.match(line)
            op = m.group(1) if m else None
            if op == "dot":
                total += _dot(line, shapes)
            elif op == "while":
                found = re.search(r"body=%?([\w.\-]+)", line)
                assert found is not None, line
                body = found.group(1)
                if '"known_trip_count"' in line:
                    n = _trips(line, trips)
                    total += n * count(body, times * n)
                else:
                    per_trip = count(body, 0)  # nested loops of unknown trips: not expected
                    if per_trip:
                        unknown.append((per_trip, times))
            else:
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                    total += count(callee, times)
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                if branches:
                    names = re.findall(r"%?([\w.\-]+)", branches.group(1))
                    total += max((count(b, times) for b in names), default=0.0)
        return total

    return LoopFlops(count(entry, 1), tuple(unknown))

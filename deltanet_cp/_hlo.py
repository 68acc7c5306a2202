"""What each rank receives, read from compiled HLO text (`jit(f).lower(...).compile().as_text()`).

Shapes in a compiled SPMD module are per device. A collective-permute delivers only to the
targets in its `source_target_pairs`, so a rank receives its operand only if it is a target;
an all-gather delivers `(group - 1) / group` of its (per-device) result to every rank of
the group. An all-reduce is counted as a bandwidth-optimal ring all-reduce receives it,
`2 (group - 1) / group` of its operand (a reduce-scatter and an all-gather); a
reduce-scatter or all-to-all as `(group - 1) / group`.

A collective inside a `while` loop runs once per trip: its figures are multiplied by the
loop's trip count (nested loops multiply), read from the compiled module (XLA's
`known_trip_count`, else the largest `s32` constant of the loop's condition, the bound a
`fori_loop` compares its index with). A collective in a branch of a `conditional` is
counted as if its branch ran. Text without an ENTRY computation (one computation's lines)
counts each collective once.
"""

import dataclasses
import math
import re


_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_KINDS = ("collective-permute", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
# `%name = <shape> <op>(operands), attrs`; the shape may be a tuple.
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)"
    r"\s+(?P<op>[\w\-]+)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module.

    **Fields:**

    - `name`: the HLO instruction name.
    - `kind`: `"collective-permute"`, `"all-gather"`, `"all-reduce"`, `"reduce-scatter"` or
        `"all-to-all"`.
    - `shapes`: the per-device result shapes (several for a tuple-shaped result).
    - `dtypes`: their element types.
    - `received`: elements received per call of the module, per rank id (ranks receiving
        nothing are absent): each run's elements times `trips`.
    - `received_bytes`: the same in bytes.
    - `trips`: how many times it runs per call: the product of the trip counts of the
        `while` loops around it (1 outside loops).
    - `trips_known`: `False` when a loop around it has a trip count the compiled module
        does not give (a bound computed at run time): that loop is counted once, so `trips`
        and the received figures are lower bounds.
    """

    name: str
    kind: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    received: dict[int, int]
    received_bytes: dict[int, int]
    trips: int = 1
    trips_known: bool = True

    @property
    def elements(self) -> int:
        """The per-device result elements (all tuple parts together)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def max_received_bytes(self) -> int:
        """The bytes received by the rank that receives the most (0 if none does), over all
        its trips."""
        return max(self.received_bytes.values(), default=0)


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\swhile\(")
_CALLEE = re.compile(
    r"\b(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)


def hlo_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """The instruction lines of each computation of an HLO module's text, and the ENTRY
    computation's name (`None` for text without one). The benchmarks' HLO readers use it too."""
    computations: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo_text.splitlines():
        if line and not line.startswith(" "):
            m = _HEADER.match(line.strip())
            current = m.group(2) if m else None
            if m and current:
                computations[current] = []
                if m.group(1):
                    entry = current
            continue
        if current and "=" in line:
            computations[current].append(line.strip())
    return computations, entry


def _trip_count(line: str, computations: dict[str, list[str]]) -> int | None:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", line)
    consts = [
        int(c)
        for body_line in computations.get(condition.group(1) if condition else "", [])
        for c in re.findall(r"s32\[\] constant\((\d+)\)", body_line)
    ]
    return max(consts, default=None)


def loop_trips(hlo_text: str) -> dict[str, int | None]:
    """The trip count of every `while` loop of a compiled module.

    Read from XLA's `known_trip_count`, else the largest `s32` constant of the loop's
    condition (the bound a `fori_loop` compares its index with); `None` where neither is
    there (a bound computed at run time, carried by the loop).

    **Arguments:**

    - `hlo_text`: a compiled module's text, `jax.jit(f).lower(*args).compile().as_text()`.

    **Returns:**

    A dict from each `while` instruction's name to its trip count, or `None`.
    """
    computations, _ = hlo_computations(hlo_text)
    trips: dict[str, int | None] = {}
    for lines in computations.values():
        for line in lines:
            m = _WHILE.match(line)
            if m:
                trips[m.group(1)] = _trip_count(line, computations)
    return trips


def _runs(hlo_text: str) -> dict[str, tuple[int, bool]]:
    """How many times each computation runs per call of the module (`while` bodies times
    their trips), and whether every loop on the way had a known trip count."""
    computations, entry = hlo_computations(hlo_text)
    if entry is None:
        return {}
    trips = loop_trips(hlo_text)
    edges: dict[str, list[tuple[str, int, bool]]] = {}
    for name, lines in computations.items():
        edges[name] = []
        for line in lines:
            m = _WHILE.match(line)
            factor, known = 1, True
            if m:
                n = trips.get(m.group(1))
                factor, known = (1, False) if n is None else (n, True)
            for _, callee in _CALLEE.findall(line):
                edges[name].append((callee, factor, known))
            branches = re.search(r"branch_computations=\{([^}]*)\}", line)
            if branches:
                for callee in re.findall(r"%?([\w.\-]+)", branches.group(1)):
                    edges[name].append((callee, 1, True))
    # Callers before callees (the call graph is acyclic), then push the counts down.
    order: list[str] = []
    seen: set[str] = set()
    stack: list[tuple[str, bool]] = [(entry, False)]
    while stack:
        name, done = stack.pop()
        if done:
            order.append(name)
            continue
        if name in seen or name not in computations:
            continue
        seen.add(name)
        stack.append((name, True))
        stack.extend((callee, False) for callee, _, _ in edges[name])
    runs = {name: (0, True) for name in order}
    runs[entry] = (1, True)
    for name in reversed(order):
        count, known = runs[name]
        for callee, factor, edge_known in edges[name]:
            if callee in runs:
                c, k = runs[callee]
                runs[callee] = (c + count * factor, k and known and edge_known)
    return runs


def _groups(rest: str) -> list[list[int]]:
    m = re.search(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}", rest)
    if m:
        return [
            [int(i) for i in g.split(",") if i.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        ]
    # Iota form: replica_groups=[G,S]<=[N] or [G,S]<=[d0,d1,...]T(perm).
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if m:
        g, s = int(m.group(1)), int(m.group(2))
        dims = [int(d) for d in m.group(3).split(",")]
        ids = list(range(math.prod(dims)))
        if m.group(4):
            perm = [int(p) for p in m.group(4).split(",")]
            strides = [math.prod(dims[i + 1 :]) for i in range(len(dims))]
            tdims = [dims[p] for p in perm]
            ids = []
            for flat in range(math.prod(dims)):
                idx, rem = [], flat
                for d in reversed(tdims):
                    idx.append(rem % d)
                    rem //= d
                idx = idx[::-1]
                ids.append(sum(idx[i] * strides[perm[i]] for i in range(len(perm))))
        return [ids[i * s : (i + 1) * s] for i in range(g)]
    return []


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in `hlo_text`, with what each rank receives.

    Asynchronous pairs (`*-start` / `*-done`) are counted once, at the start. A collective
    inside `while` loops is counted once per trip (nested loops multiply; see
    [`deltanet_cp.internal.loop_trips`][]).

    **Arguments:**

    - `hlo_text`: a compiled module's text, `jax.jit(f).lower(*args).compile().as_text()`.

    **Returns:**

    A list of [`deltanet_cp.internal.Collective`][], in the order they appear in the text.
    """
    runs = _runs(hlo_text)
    found = []
    computation = None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line) if line and not line.startswith(" ") else None
        if header:
            computation = header.group(2)
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        op = m.group("op")
        kind = op[: -len("-start")] if op.endswith("-start") else op
        if kind not in _KINDS:
            continue
        arrays = [
            (dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(m.group("shape"))
        ]
        if (
            op.endswith("-start")
            and kind in ("collective-permute", "all-gather")
            and len(arrays) >= 2
        ):
            # (operand(s), result(s), ...): keep the results.
            half = len(arrays) // 2
            arrays = arrays[half:] if kind == "all-gather" else arrays[1:2]
        dtypes = tuple(a[0] for a in arrays)
        shapes = tuple(a[1] for a in arrays)
        nbytes_per_elem = [_DTYPE_BYTES.get(dt, 4) for dt in dtypes]
        elems = [math.prod(s) for s in shapes]
        total_e = sum(elems)
        total_b = sum(e * b for e, b in zip(elems, nbytes_per_elem))
        rest = m.group("rest")
        received: dict[int, int] = {}
        received_b: dict[int, int] = {}
        if kind == "collective-permute":
            pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
            targets = (
                [int(t) for _, t in re.findall(r"\{(\d+),(\d+)", pairs.group(1) + "}")]
                if pairs
                else []
            )
            for t in targets:
                received[t] = received.get(t, 0) + total_e
                received_b[t] = received_b.get(t, 0) + total_b
        else:
            factor = 2 if kind == "all-reduce" else 1
            for group in _groups(rest):
                n = len(group)
                for r in group:
                    received[r] = factor * total_e * (n - 1) // n
                    received_b[r] = factor * total_b * (n - 1) // n
        # Outside the computations reached from ENTRY (or with no ENTRY): once.
        trips, known = runs.get(computation or "", (1, True))
        found.append(
            Collective(
                m.group("name"),
                kind,
                shapes,
                dtypes,
                {r: n * trips for r, n in received.items()},
                {r: n * trips for r, n in received_b.items()},
                trips,
                known,
            )
        )
    return found


def received_bytes_per_rank(hlo_text: str, kinds: tuple[str, ...] = _KINDS) -> dict[int, int]:
    """Total bytes each rank receives over the collectives of the given kinds.

    **Arguments:**

    - `hlo_text`: a compiled module's text, `jax.jit(f).lower(*args).compile().as_text()`.
    - `kinds`: which collectives to count.

    **Returns:**

    A dict from rank id to bytes received (ranks receiving nothing are absent). A collective
    inside `while` loops counts once per trip (nested loops multiply).

    **Raises:**

    `ValueError` if a collective of those kinds sits in a loop whose trip count the module
    does not give: [`deltanet_cp.internal.collectives`][] then gives lower bounds, marked
    by `trips_known=False`.
    """
    total: dict[int, int] = {}
    for c in collectives(hlo_text):
        if c.kind in kinds:
            if not c.trips_known:
                raise ValueError(
                    f"{c.kind} {c.name} is inside a while loop whose trip count the compiled "
                    "module does not give (a bound computed at run time), so its bytes cannot "
                    "be totalled; use deltanet_cp.internal.collectives(hlo_text), whose "
                    "Collective.trips_known=False marks such figures as lower bounds"
                )
            for r, b in c.received_bytes.items():
                total[r] = total.get(r, 0) + b
    return total


# The products of a StableHLO module (`jax.jit(f).lower(...).as_text()`, or an exported
# module's `mlir_module()`): their operand and result dtypes and where in the source they are.

_DOT = re.compile(
    r"stablehlo\.dot_general .*?: \(tensor<(?P<lhs>[^>]*)>, tensor<(?P<rhs>[^>]*)>\) -> "
    r"tensor<(?P<out>[^>]*)>.*loc\((?P<loc>#loc\d+)\)\s*$"
)
_LOC = re.compile(r"^(#loc\d+) = loc\((.*)\)\s*$", re.M)
_SPEC = re.compile(r"[\w.]+,[\w.]+->[\w.]*")


@dataclasses.dataclass(frozen=True)
class Product:
    """One `dot_general` of a StableHLO module.

    **Fields:**

    - `operands`: the two operands' element types, e.g. `("bf16", "f32")`.
    - `result`: the result's element type.
    - `shapes`: the operands' and the result's shapes.
    - `spec`: the `einsum` subscripts it came from, or `""`.
    - `frames`: the Python frames that emitted it, innermost first, as `"function file:line"`.
    """

    operands: tuple[str, str]
    result: str
    shapes: tuple[tuple[int, ...], ...]
    spec: str
    frames: tuple[str, ...]

    def where(self, skip: tuple[str, ...] = ("_precision.py",)) -> str:
        """The innermost frame outside the files in `skip` (the einsum wrappers)."""
        for frame in self.frames:
            if not any(s in frame for s in skip):
                return frame
        return self.frames[0] if self.frames else "?"


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
    *dims, dtype = text.split("x")
    return tuple(int(d) for d in dims), dtype


def products(text: str) -> list[Product]:
    """Every `dot_general` of a StableHLO module's text, with its dtypes and source frames.

    **Arguments:**

    - `text`: the module, with its debug locations (`lowered.as_text()`, or
        `jax.export.export(...)(...).mlir_module()`).

    **Returns:**

    One [`Product`][] per `dot_general` in the module's text (each once, however often a
    loop runs it).
    """
    locs = dict(_LOC.findall(text))

    def frames(ref: str, depth: int = 0) -> list[tuple[str, str]]:
        body = locs.get(ref, "")
        if depth > 64 or not body:
            return []
        if body.startswith("callsite("):
            inner = re.match(r"callsite\((#loc\d+) at (#loc\d+)\)", body)
            return (
                frames(inner.group(1), depth + 1) + frames(inner.group(2), depth + 1)
                if inner
                else []
            )
        named = re.match(r'"([^"]*)"\((#loc\d+)\)', body)
        if named:
            sub = locs.get(named.group(2), "")
            place = re.match(r'"([^"]*)":(\d+)', sub)
            if place:
                return [(named.group(1), f"{place.group(1).rsplit('/', 1)[-1]}:{place.group(2)}")]
            return [(named.group(1), "")] + frames(named.group(2), depth + 1)
        place = re.match(r'"([^"]*)":(\d+)', body)
        return [("", f"{place.group(1).rsplit('/', 1)[-1]}:{place.group(2)}")] if place else []

    found = []
    for line in text.splitlines():
        m = _DOT.search(line)
        if m is None:
            continue
        (ls, lt), (rs, rt), (os_, ot) = (_tensor(m.group(k)) for k in ("lhs", "rhs", "out"))
        chain = frames(m.group("loc"))
        spec = next((s.group(0) for n, _ in chain if (s := _SPEC.search(n))), "")
        named = tuple(f"{n} {p}".strip() for n, p in chain if p)
        found.append(Product((lt, rt), ot, (ls, rs, os_), spec, named))
    return found

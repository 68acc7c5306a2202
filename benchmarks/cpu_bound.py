"""What bounds the chunked kernel on XLA:CPU: threads, batched products, and where time goes.

Four tables, each measured in this one process, every configuration compiled both with
XLA:CPU's defaults and with its YNNPACK fusions turned off for that one compile
(`jax.jit(..., compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""})`, which
leaves the rest of the process alone):

1. Products of the kernel's shapes vs one plain 2D matmul: milliseconds, GFLOP/s, and the
   cores the process kept busy (CPU time / wall time). A batched product of many small
   per-chunk matrices runs on one core; a plain matmul uses every core.
2. One batched product vs the same product as two independent halves in one jitted
   function: XLA:CPU runs them one after the other, not side by side, so splitting the
   batch does not buy a second core.
3. How fast XLA:CPU writes a new buffer vs how fast it reads one (the elementwise work of
   the kernel writes many such intermediates).
4. The compiled forward of `chunk_gated_delta_rule` at the first `make bench` shape
   (B=1, T=4096, H=HV=4, K=V=128, chunk 64), traced with `jax.profiler`: the time of each
   XLA operation, grouped into products (dot fusions), the sequential scan over chunks and
   the elementwise work and copies; with the forward and forward+backward wall times and
   cores used.

    python benchmarks/cpu_bound.py
"""

import collections
import glob
import gzip
import json
import re
import resource
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import gdn_inputs, machine_line, NO_YNN, print_table

import deltanet_cp as dcp


CONFIGS = [("default", None), ("YNNPACK off", NO_YNN)]
HI = jax.lax.Precision.HIGHEST


def busy(fn, *args, calls: int = 15) -> tuple[float, float]:
    """Median wall ms per call, and the cores kept busy (process CPU time / wall time)."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    walls = []
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        walls.append(time.perf_counter() - start)
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return statistics.median(walls) * 1e3, cpu / wall


def products_table(rng) -> list[list]:
    n, c, dk = 256, 64, 128  # 64 chunks x 4 heads at the first bench shape
    cases = {
        "2D matmul 1024x1024 @ 1024x1024": (
            lambda a, b: a @ b,
            [(1024, 1024), (1024, 1024)],
            2 * 1024**3,
        ),
        f"batched {n} x (64x64 @ 64x256): [w | u] = T [k | v]": (
            lambda a, b: jnp.einsum("nij,njd->nid", a, b, precision=HI),
            [(n, c, c), (n, c, 2 * dk)],
            2 * n * c * c * 2 * dk,
        ),
        f"batched {n} x (64x128 @ 128x64): k k^T": (
            lambda a, b: jnp.einsum("nik,njk->nij", a, b, precision=HI),
            [(n, c, dk), (n, c, dk)],
            2 * n * c * c * dk,
        ),
        "same flops as one 2D matmul: 16384x64 @ 64x256": (
            lambda a, b: a.reshape(-1, c) @ b[0],
            [(n, c, c), (n, c, 2 * dk)],
            2 * n * c * c * 2 * dk,
        ),
        "scan step: 4 x (128x128 @ 128x128), 64 steps": (
            lambda a, h: jax.lax.scan(
                lambda h, x: (jnp.einsum("bck,bkv->bcv", x, h, precision=HI), None), h, a
            )[0],
            [(64, 4, 128, 128), (4, 128, 128)],
            64 * 2 * 4 * 128**3,
        ),
    }
    rows = []
    for label, (fn, shapes, flops) in cases.items():
        args = [jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]
        row = [label]
        for _, options in CONFIGS:
            ms, cores = busy(jax.jit(fn, compiler_options=options), *args)
            row += [f"{ms:.2f}", f"{flops / ms / 1e6:.0f}", f"{cores:.2f}"]
        rows.append(row)
    return rows


def concurrency_table(rng) -> list[list]:
    a = jnp.asarray(rng.standard_normal((256, 64, 64), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((256, 64, 256), dtype=np.float32))

    def one(a, b):
        return jnp.einsum("nij,njd->nid", a, b, precision=HI)

    def halves(a, b):  # the same work as two independent products
        return jnp.concatenate([one(a[:128], b[:128]), one(a[128:], b[128:])])

    rows = []
    for name, options in CONFIGS:
        t_one, c_one = busy(jax.jit(one, compiler_options=options), a, b)
        t_halves, c_halves = busy(jax.jit(halves, compiler_options=options), a, b)
        rows.append(
            [
                name,
                f"{t_one:.2f}",
                f"{c_one:.2f}",
                f"{t_halves:.2f}",
                f"{c_halves:.2f}",
            ]
        )
    return rows


def memory_table() -> list[list]:
    rows = []
    for mib in [4, 16, 64, 256]:
        x = jnp.ones((mib * 2**20 // 4,), jnp.float32)
        write_ms, _ = busy(jax.jit(lambda x: x * 2.0), x, calls=9)
        read_ms, _ = busy(jax.jit(jnp.sum), x, calls=9)
        rows.append(
            [
                mib,
                f"{write_ms:.2f}",
                f"{2 * mib / 1024 / (write_ms / 1e3):.1f}",
                f"{read_ms:.2f}",
                f"{mib / 1024 / (read_ms / 1e3):.1f}",
            ]
        )
    return rows


def forward(q, k, v, g, beta):
    return dcp.chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, chunk_size=64
    )


def loss(*args):
    o, h = forward(*args)
    return jnp.sum(o * o) + jnp.sum(h * h)


_OP = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = .*? ([a-z][\w\-]*)\(")


def categories(compiled_text: str) -> dict[str, str]:
    """Operation name -> 'products' / 'elementwise, copies' / ..., from the compiled HLO."""
    comps: dict[str, list[str]] = {}
    lines = comps.setdefault("", [])
    for line in compiled_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            lines = comps.setdefault(name.lstrip("%"), [])
        else:
            lines.append(line)
    kinds = {}
    for body in comps.values():
        for line in body:
            m = _OP.match(line)
            if m is None:
                continue
            name, op = m.groups()
            if op == "fusion":
                called = line.split("calls=%", 1)[1].split(",")[0].split()[0]
                inner = "\n".join(comps.get(called, []))
                kinds[name] = "products" if " dot(" in inner else "elementwise, copies"
            elif op in ("dot", "convolution"):
                kinds[name] = "products"
            elif op in ("while", "call", "conditional"):
                kinds[name] = "control"
            else:
                kinds[name] = "elementwise, copies"
    return kinds


def profile_rows(fn, args, options, repeats: int = 3) -> tuple[dict[str, float], float]:
    compiled = jax.jit(fn, compiler_options=options).lower(*args).compile()
    kinds = categories(compiled.as_text() or "")
    for _ in range(3):
        jax.block_until_ready(compiled(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(compiled(*args))
        (path,) = glob.glob(f"{d}/**/perfetto_trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # An operation split over threads shows as overlapping events: count the wall time
    # each kind of operation occupies (the union of its intervals), not the sum.
    spans = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and kinds.get(e["name"], "control") != "control":
            spans[kinds[e["name"]]].append((e["ts"], e["ts"] + e.get("dur", 0)))
    per_kind = {kind: _union(s) / 1e3 / repeats for kind, s in spans.items()}
    return per_kind, _union([x for s in spans.values() for x in s]) / 1e3 / repeats


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def main():
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {machine_line()}")
    print_table(
        ["product (float32)"]
        + [f"{n} {col}" for n, _ in CONFIGS for col in ("ms", "GFLOP/s", "cores busy")],
        products_table(rng),
        title="1. Batched per-chunk products vs one 2D matmul (cores busy = CPU time / wall)",
    )
    print_table(
        [
            "XLA:CPU",
            "one batched product ms",
            "cores busy",
            "as two independent halves ms",
            "cores busy",
        ],
        concurrency_table(rng),
        title="2. The batched product 256 x (64x64 @ 64x256), whole and as two independent "
        "halves in one jit",
    )
    print_table(
        [
            "MiB",
            "x * 2 ms (new buffer)",
            "GiB/s read + written",
            "sum(x) ms",
            "GiB/s read",
        ],
        memory_table(),
        title="3. Memory: an elementwise op into a new buffer vs a reduction, float32 vectors",
    )
    args = [jnp.asarray(x) for x in gdn_inputs(rng, 1, 4096, 4, 4, 128)]
    rows, shares = [], []
    for name, options in CONFIGS:
        fwd_ms, fwd_cores = busy(jax.jit(forward, compiler_options=options), *args, calls=9)
        grad = jax.jit(jax.grad(loss, argnums=range(5)), compiler_options=options)
        fb_ms, fb_cores = busy(grad, *args, calls=5)
        per_kind, total = profile_rows(forward, args, options)
        rows.append(
            [
                name,
                f"{fwd_ms:.1f}",
                f"{fwd_cores:.2f}",
                f"{fb_ms:.1f}",
                f"{fb_cores:.2f}",
                f"{total:.1f}",
            ]
            + [
                f"{per_kind.get(k, 0.0):.1f} ({per_kind.get(k, 0.0) / total:.0%})"
                for k in ("products", "elementwise, copies")
            ]
        )
        shares.append(per_kind)
    print_table(
        [
            "XLA:CPU",
            "fwd ms",
            "fwd cores busy",
            "fwd+bwd ms",
            "fwd+bwd cores busy",
            "traced ops ms",
            "products ms (share)",
            "elementwise, copies ms (share)",
        ],
        rows,
        title="4. chunk_gated_delta_rule at B=1, T=4096, H=HV=4, K=V=128, chunk 64 "
        "(traced ops: wall time covered by the forward's XLA operations, scan iterations included)",
    )
    print(f"\nmachine after: {machine_line()}")


if __name__ == "__main__":
    main()

"""What context parallelism costs per rank: flops, bytes received, temporaries, and what the
zigzag layout and an unused final state cost.

Compiles `chunk_gated_delta_rule(..., cp=ContextParallel(...))` inside `shard_map` over
simulated CPU devices (and the single-device kernel on one rank's share of the tokens) and
reads XLA's own accounting from the compiled modules. B = 1, H = HV = 4, K = V = 128,
chunk 64, q/k L2 norm, float32. Four tables (`--only` picks some):

- `flops`: flops per rank, `cost_analysis()` corrected for loops (XLA counts a while body
  once): what phase 1 (composing the rank's chunks into its map `(M, U)`) and the exchange
  add to the single-device kernel on the same tokens.
- `payload`: bytes received per rank, read from the collectives of the compiled HLO
  (`deltanet_cp.internal.received_bytes_per_rank`), beside the exchange's cost model
  (`_common.payload_bytes`), cp = 2, 4, 8: flat in the sequence length.
- `step`: bytes received per rank, forward and training step (the gradient of a loss of
  the outputs, the final state unused), for each exchange (`Auto` too) at cp = 4 with
  Qwen3-Next's Gated DeltaNet heads (H = 16, HV = 32, K = V = 128) at T = 1024: what the
  README and the exchanges page quote.
- `memory`: temporaries per device, `memory_analysis()`, at several tokens per rank.
- `layouts`: contiguous vs zigzag shards at T = 4096 on cp = 4, each exchange: bytes the
  busiest rank receives forward and forward + backward (HLO, beside the cost model),
  temporaries per local token, and then the same bytes with the final state returned but
  left unused (what a caller who ignores it pays) with the number of collectives; last,
  forward + backward wall time, zigzag over contiguous, paired in this process (both run
  alternately in the same rounds, the ratio the median of per-round ratios; simulated
  devices share the cores, so this is total work, not a multi-host step time).

    python benchmarks/cp_cost.py                      # every table (about 4 minutes)
    python benchmarks/cp_cost.py --only layouts       # one table
    python benchmarks/cp_cost.py --quick              # tiny heads and lengths, a smoke test
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    gdn_inputs,
    machine_line,
    paired_ratio,
    paired_times,
    payload_bytes,
    print_table,
)
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402


EXCHANGES = {"allgather": dcp.AllGather(), "ppermute": dcp.PPermute(), "ring": dcp.Ring()}
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}
TABLES = ("flops", "payload", "step", "memory", "layouts")


@dataclasses.dataclass(frozen=True)
class Case:
    """Heads and sizes of one run: `tokens` per rank for the flops table, `sizes` per rank
    for the memory table, `layouts_t` and `layouts_cp` for the layouts table."""

    b: int = 1
    h: int = 4
    hv: int = 4
    d: int = 128
    c: int = 64
    cps: tuple[int, ...] = (2, 4, 8)
    tokens: int = 1024
    sizes: tuple[int, ...] = (1024, 2048, 4096)
    layouts_t: int = 4096
    layouts_cp: int = 4
    rounds: int = 5

    @property
    def map_elements(self) -> int:
        return self.b * self.hv * self.d * (self.d + self.d)

    @property
    def state_elements(self) -> int:
        return self.b * self.hv * self.d * self.d

    def label(self) -> str:
        return f"B={self.b}, H={self.h}, HV={self.hv}, K=V={self.d}, chunk {self.c}, float32"


FULL = Case()
QUICK = Case(h=2, hv=2, d=32, cps=(2, 4), tokens=256, sizes=(256, 512), layouts_t=512, rounds=2)
# Qwen3-Next-80B-A3B's Gated DeltaNet heads, at cp = 4 and 256 tokens per rank.
QWEN3_NEXT = Case(h=16, hv=32, d=128, cps=(4,), tokens=256)


def shapes(case: Case, t: int, sharding=None) -> list:
    dims = [(t, case.h, case.d), (t, case.h, case.d), (t, case.hv, case.d), (t, case.hv)]
    dims.append((t, case.hv))
    return [jax.ShapeDtypeStruct((case.b, *s), jnp.float32, sharding=sharding) for s in dims]


def programs(case: Case, cp: int, exchange, layout=None):
    """`(mesh, forward, grad, grad_unused)` over a `cp`-device mesh, on arrays already in the
    layout's order (as a training loop keeps them): the forward, the gradient of a loss of
    the outputs and the final state, and the gradient of a loss of the outputs only (the
    final state returned and left unused)."""
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P(None, "cp")
    parallel = dcp.ContextParallel("cp", layout=layout or dcp.Contiguous(), exchange=exchange)

    def per_rank(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=case.c, cp=parallel
        )

    forward = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,) * 5, out_specs=(seq, P()))

    def loss(*args):
        o, h = forward(*args)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(h * h)

    def loss_unused(*args):
        o, _ = forward(*args)
        return jnp.sum(o * jnp.cos(o))

    argnums = tuple(range(5))
    grads = [jax.jit(jax.grad(f, argnums=argnums)) for f in (loss, loss_unused)]
    return mesh, jax.jit(forward), *grads


def compile_sharded(fn, mesh, case: Case, t: int):
    return fn.lower(*shapes(case, t, NamedSharding(mesh, P(None, "cp")))).compile()


def compile_single(fn, case: Case, chunks: int):
    return jax.jit(fn).lower(*shapes(case, chunks * case.c)).compile()


def raw_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def temp_bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    return memory.temp_size_in_bytes


def received(compiled) -> int:
    """Bytes the busiest rank receives, from the collectives of the compiled HLO."""
    return max(dcp.internal.received_bytes_per_rank(compiled.as_text() or "").values(), default=0)


def mib(x: float, digits: int = 3) -> str:
    return f"{x / 2**20:.{digits}f}"


# ------------------------------------------------------------------ flops


def flops_table(case: Case) -> None:
    rule = dcp.GatedDeltaRule(chunk_size=case.c, use_qk_l2norm=True)

    def single(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=case.c)

    def prepare_only(q, k, v, g, beta):
        """The per-chunk factors, as the engine forms them (no loop)."""
        n = q.shape[1] // case.c
        inputs = dcp.DeltaInputs(q, k, v, g, beta)
        return rule.prepare(
            jax.tree.map(lambda x: x.reshape(x.shape[0], n, case.c, *x.shape[2:]), inputs)
        )

    def phase1_only(q, k, v, g, beta):
        """Phase 1 on one rank: prepare, then compose the chunks into the rank's map."""
        factors = prepare_only(q, k, v, g, beta)
        identity = dcp.AffineMap.identity(case.d, case.d, (case.b, case.hv))
        running, _ = jax.lax.scan(lambda m, f: (rule.compose(f, m), None), identity, factors)
        return running

    def loop_corrected(fn, n):
        """Flops of `fn` (whose loops all run over the chunks) at `n` chunks, fit on 2 and 4."""
        f2, f4 = (raw_flops(compile_single(fn, case, m)) for m in (2, 4))
        per_item = (f4 - f2) / 2
        return (f2 - per_item) * n

    # The single-device kernel is prepare + the scan; CP adds phase 1 (the composition of
    # the rank's chunks into (M, U), reusing prepare's factors) and the exchange. Phase 1's
    # loop-corrected flops are those of prepare + composition minus prepare's (no loop).
    n = case.tokens // case.c
    one = loop_corrected(single, n)
    prep = raw_flops(compile_single(prepare_only, case, n))
    phase1 = loop_corrected(phase1_only, n) - prep
    analytic = 4 * case.c * case.d * (case.d + case.d) * n * case.b * case.hv
    rows = []
    for cp in case.cps:
        # Loops counted once in each raw count, so these differences isolate the exchange.
        mesh, forward, _, _ = programs(case, cp, EXCHANGES["allgather"])
        exchange = (
            raw_flops(compile_sharded(forward, mesh, case, 2 * case.c * cp))
            - raw_flops(compile_single(single, case, 2))
            - raw_flops(compile_single(phase1_only, case, 2))
            + raw_flops(compile_single(prepare_only, case, 2))
        )
        total = one + phase1 + exchange
        rows.append(
            [cp, case.tokens, f"{one / 1e9:.3f}", f"{phase1 / 1e9:.3f}", f"{analytic / 1e9:.3f}"]
            + [f"{exchange / 1e9:.4f}", f"{(total - one) / one:+.0%}"]
        )
    print_table(
        ["cp", "tokens per rank", "single-device GFLOP", "phase 1 GFLOP"]
        + ["phase 1 analytic 4CK(K+V)/chunk", "exchange GFLOP", "CP extra vs single device"],
        rows,
        title="Flops per rank (XLA cost analysis, loop-corrected): what CP adds to the "
        "single-device kernel on the same tokens (allgather exchange)",
    )


# ------------------------------------------------------------------ payload and memory


def payload_table(case: Case) -> None:
    rows = []
    for name, exchange in EXCHANGES.items():
        for cp in case.cps:
            mesh, forward, _, _ = programs(case, cp, exchange)
            got = received(compile_sharded(forward, mesh, case, case.tokens * cp))
            model = payload_bytes(
                exchange,
                cp,
                map_elements=case.map_elements,
                state_elements=case.state_elements,
                final_state=True,
            )
            rows.append([name, cp, mib(got), mib(model)])
    print_table(
        ["exchange", "cp", "MiB received per rank (HLO)", "payload_elements x 4 B"],
        rows,
        title="Phase-2 payload per rank, read from the compiled HLO (with the final state; the "
        "same at every sequence length)",
    )


def step_table(case: Case) -> None:
    heads = QWEN3_NEXT if case is FULL else case
    cp, t = heads.cps[-1], heads.tokens * heads.cps[-1]
    exchanges = {**EXCHANGES, "auto": dcp.Auto()}
    rows = []
    for name, exchange in exchanges.items():
        mesh, forward, _, grad_unused = programs(heads, cp, exchange)

        def loss_unused(*args, forward=forward):
            return jnp.sum(forward(*args)[0] ** 2)

        fwd = received(compile_sharded(jax.jit(loss_unused), mesh, heads, t))
        step = received(compile_sharded(grad_unused, mesh, heads, t))
        m, s = heads.map_elements, heads.state_elements
        chosen = exchange
        if isinstance(exchange, dcp.Auto):
            chosen = exchange.choose(cp, map_elements=m, state_elements=s)
            name = f"auto ({type(chosen).__name__})"
        model = payload_bytes(chosen, cp, map_elements=m, state_elements=s)
        rows.append([name, mib(fwd, 2), mib(model, 2), mib(step, 2), f"{step / fwd:.2f}"])
        print(f"  {name}: compiled", flush=True)
    print_table(
        ["exchange", "forward MiB (HLO)", "payload_elements x 4 B", "training step MiB"]
        + ["step / forward"],
        rows,
        title=f"Bytes received per rank per layer, cp = {cp}, T = {t}, "
        f"{heads.label()} (the same at every T; the final state unused):",
    )


def memory_table(case: Case) -> None:
    rows = []
    cps = (case.cps[0], case.cps[-1])
    for name in ["allgather", "ring"]:
        for cp in cps:
            mesh, forward, _, _ = programs(case, cp, EXCHANGES[name])
            temps = [temp_bytes(compile_sharded(forward, mesh, case, s * cp)) for s in case.sizes]
            rows.append([name, cp] + [mib(t, 1) for t in temps])
            rows[-1].append(f"{temps[-1] / case.sizes[-1] / 1024:.1f}")

    def single(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=case.c)

    temps = [temp_bytes(compile_single(single, case, s // case.c)) for s in case.sizes]
    rows.append(["single device", 1] + [mib(t, 1) for t in temps])
    rows[-1].append(f"{temps[-1] / case.sizes[-1] / 1024:.1f}")
    print_table(
        ["exchange", "cp"] + [f"temp MiB at S/cp = {s}" for s in case.sizes] + ["KiB per token"],
        rows,
        title="Temporary memory per device (memory_analysis): linear in the tokens per rank",
    )


# ------------------------------------------------------------------ layouts


def layouts_tables(case: Case) -> None:
    t, cp = case.layouts_t, case.layouts_cp
    print(f"\nLayouts: T={t}, cp={cp} ({t // cp} tokens/rank)")
    data = gdn_inputs(np.random.default_rng(0), case.b, t, case.h, case.hv, case.d)
    rows, unused_rows, calls = [], [], {}
    for ex_name, exchange in EXCHANGES.items():
        for lay_name, layout in LAYOUTS.items():
            mesh, forward, grad, grad_unused = programs(case, cp, exchange, layout)
            fwd_c, grad_c, unused_c = (
                compile_sharded(f, mesh, case, t) for f in (forward, grad, grad_unused)
            )
            model = payload_bytes(
                exchange,
                cp,
                map_elements=case.map_elements,
                state_elements=case.state_elements,
                final_state=True,
                layout=layout,
            )
            temps = [temp_bytes(c) / 1024 / (t // cp) for c in (fwd_c, grad_c)]
            rows.append(
                [ex_name, lay_name, mib(received(fwd_c), 2), mib(model, 2)]
                + [mib(received(grad_c), 2), f"{temps[0]:.1f}", f"{temps[1]:.1f}"]
            )

            def loss_unused(*args, forward=forward):
                return jnp.sum(forward(*args)[0] ** 2)

            fwd_unused = jax.jit(loss_unused)
            fwd_unused_c = compile_sharded(fwd_unused, mesh, case, t)
            unused_rows.append(
                [ex_name, lay_name]
                + [
                    x
                    for c in (fwd_unused_c, unused_c)
                    for x in (f"{received(c):,}", len(dcp.internal.collectives(c.as_text() or "")))
                ]
            )
            print(f"  {ex_name}, {lay_name}: compiled", flush=True)
            placed = [jax.device_put(x, NamedSharding(mesh, P(None, "cp"))) for x in data]

            def call(grad=grad, placed=placed):
                jax.block_until_ready(grad(*placed))

            call()  # warm up
            calls[f"{ex_name} {lay_name}"] = call
    print_table(
        ["exchange", "layout", "fwd MiB recv (HLO)", "fwd formula", "fwd+bwd MiB recv"]
        + ["fwd KiB/token", "fwd+bwd KiB/token"],
        rows,
        title="Per rank, with the global final state:",
    )
    print_table(
        ["exchange", "layout", "fwd bytes", "fwd collectives", "grad bytes", "grad collectives"],
        unused_rows,
        title="Per rank, a loss of the outputs only (the final state returned, left unused):",
    )
    times = paired_times(calls, case.rounds)
    ratio_rows = []
    for ex_name in EXCHANGES:
        zig, con = times[f"{ex_name} zigzag"], times[f"{ex_name} contiguous"]
        ratio_rows.append(
            [ex_name, f"{np.median(con):.3f}", f"{np.median(zig):.3f}"]
            + [f"{paired_ratio(zig, con):.2f}"]
        )
    print_table(
        ["exchange", "contiguous s", "zigzag s", "zigzag / contiguous (paired median)"],
        ratio_rows,
        title=f"Forward + backward wall time, {case.rounds} paired rounds:",
    )


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny heads and lengths")
    parser.add_argument("--only", default=",".join(TABLES), help="comma-separated tables")
    args = parser.parse_args()
    tables = args.only.split(",")
    if unknown := sorted(set(tables) - set(TABLES)):
        parser.error(f"unknown table(s) {unknown}; choose from {', '.join(TABLES)}")
    case = QUICK if args.quick else FULL
    print(f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices; {case.label()}")
    print(f"machine: {machine_line()}")
    for name, table in zip(
        TABLES, (flops_table, payload_table, step_table, memory_table, layouts_tables), strict=True
    ):
        if name in tables:
            table(case)
    print(f"\nmachine after: {machine_line()}")


if __name__ == "__main__":
    main()

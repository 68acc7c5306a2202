"""What context parallelism costs per rank: flops, bytes received, temporary memory.

Compiles the CP kernel (`chunk_gated_delta_rule(..., cp=ContextParallel(...))` inside
`shard_map`, simulated CPU devices) and the single-device kernel on one rank's share of the
tokens, and reads XLA's own accounting from the compiled modules:

- flops: `cost_analysis()`, corrected for loops (XLA counts a while body once); the extra
  flops of CP are those of phase 1 (composing the rank's chunks into its map `(M, U)`).
- bytes received per rank in phase 2, from the collectives in the compiled HLO.
- temporary memory per device, from `memory_analysis()`, at several tokens per rank.

    python benchmarks/cp_cost.py
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import print_table  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp._chunking import num_chunks, split_chunks  # noqa: E402


B, H, HV, D, C = 1, 4, 4, 128, 64
EXCHANGES = {"allgather": dcp.AllGather(), "ppermute": dcp.PPermute(), "ring": dcp.Ring()}
# Elements of one rank's dense map (M, U) and of one state, as the exchanges count them.
MAP_ELEMENTS, STATE_ELEMENTS = B * HV * D * (D + D), B * HV * D * D


def inputs(t):
    shapes = [(B, t, H, D), (B, t, H, D), (B, t, HV, D), (B, t, HV), (B, t, HV)]
    return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]


def single(q, k, v, g, beta):
    return dcp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C)


def sharded(cp, exchange):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P(None, "cp")
    parallel = dcp.ContextParallel("cp", exchange=exchange)

    def per_rank(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C, cp=parallel
        )

    fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,) * 5, out_specs=(seq, P())))
    shard = NamedSharding(mesh, seq)

    def lower(t):
        args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in inputs(t)]
        return fn.lower(*args).compile()

    return lower


def raw_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


def temp_bytes(compiled) -> int:
    memory = compiled.memory_analysis()
    assert memory is not None, "this backend reports no memory analysis"
    return memory.temp_size_in_bytes


def compile_single(fn, m):
    return jax.jit(fn).lower(*inputs(m * C)).compile()


def loop_corrected(fn, n):
    """Flops of `fn` (whose loops all run over the chunks) at `n` chunks, fit on 2 and 4."""
    f2, f4 = (raw_flops(compile_single(fn, m)) for m in (2, 4))
    per_item = (f4 - f2) / 2
    return (per_item + f2 - 2 * per_item) * n


RECURRENCE = dcp.GatedDeltaRule(chunk_size=C, use_qk_l2norm=True)


def prepare_only(q, k, v, g, beta):
    """The per-chunk factors, as the engine forms them (no loop)."""
    n = num_chunks(q.shape[1], C)
    inputs = dcp.DeltaInputs(q, k, v, g, beta)
    return RECURRENCE.prepare(jax.tree.map(lambda x: split_chunks(x, n, C), inputs))


def phase1_only(q, k, v, g, beta):
    """Phase 1 on one rank: prepare, then compose the chunks into the rank's map (M, U)."""
    factors = prepare_only(q, k, v, g, beta)
    identity = dcp.AffineMap.identity(D, D, (B, HV))

    def body(running, f):
        return RECURRENCE.compose(f, running), None

    running, _ = jax.lax.scan(body, identity, factors)
    return running


def main():
    print(
        f"jax {jax.__version__}, {len(jax.devices())} simulated CPU devices; B={B}, H=HV={H}, "
        f"K=V={D}, chunk {C}, float32"
    )
    # 1. Flops per rank. The single-device kernel is prepare + the scan; CP adds phase 1
    # (the low-rank composition of the rank's chunks into (M, U), reusing prepare's factors)
    # and the exchange. Phase 1's loop-corrected flops are those of prepare + composition
    # minus prepare's (which has no loop).
    rows = []
    tokens = 1024
    n = tokens // C
    one = loop_corrected(single, n)
    prep = raw_flops(compile_single(prepare_only, n))
    phase1 = loop_corrected(phase1_only, n) - prep
    analytic = 4 * C * D * (D + D) * n * B * HV
    for cp in [2, 4, 8]:
        # Loops counted once in each raw count, so these differences isolate the exchange.
        m = 2
        cp_raw = raw_flops(sharded(cp, EXCHANGES["allgather"])(m * C * cp))
        exchange = (
            cp_raw
            - raw_flops(compile_single(single, m))
            - raw_flops(compile_single(phase1_only, m))
            + raw_flops(compile_single(prepare_only, m))
        )
        total = one + phase1 + exchange
        rows.append(
            [
                cp,
                tokens,
                f"{one / 1e9:.3f}",
                f"{phase1 / 1e9:.3f}",
                f"{analytic / 1e9:.3f}",
                f"{exchange / 1e9:.4f}",
                f"{(total - one) / one:+.0%}",
            ]
        )
    print_table(
        [
            "cp",
            "tokens per rank",
            "single-device GFLOP",
            "phase 1 GFLOP",
            "phase 1 analytic 4CK(K+V)/chunk",
            "exchange GFLOP",
            "CP extra vs single device",
        ],
        rows,
        title="Flops per rank (XLA cost analysis, loop-corrected): what CP adds to the "
        "single-device kernel on the same tokens (allgather exchange)",
    )
    # 2. Bytes received per rank in phase 2.
    rows = []
    for name, exchange in EXCHANGES.items():
        for cp in [2, 4, 8]:
            text = sharded(cp, exchange)(1024 * cp).as_text() or ""
            got = max(dcp.received_bytes_per_rank(text).values(), default=0)
            expected = 4 * exchange.payload_elements(
                cp, map_elements=MAP_ELEMENTS, state_elements=STATE_ELEMENTS, final_state=True
            )
            rows.append([name, cp, f"{got / 2**20:.3f}", f"{expected / 2**20:.3f}"])
    print_table(
        ["exchange", "cp", "MiB received per rank (HLO)", "payload_elements x 4 B"],
        rows,
        title="Phase-2 payload per rank, read from the compiled HLO (with the final state; the "
        "same at every sequence length)",
    )
    # 3. Temporary memory per device at several tokens per rank.
    sizes = [1024, 2048, 4096]
    rows = []
    for name in ["allgather", "ring"]:
        for cp in [2, 8]:
            lower = sharded(cp, EXCHANGES[name])
            temps = [temp_bytes(lower(s * cp)) for s in sizes]
            rows.append(
                [name, cp]
                + [f"{t / 2**20:.1f}" for t in temps]
                + [f"{temps[-1] / sizes[-1] / 1024:.1f}"]
            )
    temps = [temp_bytes(compile_single(single, s // C)) for s in sizes]
    rows.append(
        ["single device", 1]
        + [f"{t / 2**20:.1f}" for t in temps]
        + [f"{temps[-1] / sizes[-1] / 1024:.1f}"]
    )
    print_table(
        ["exchange", "cp"] + [f"temp MiB at S/cp = {s}" for s in sizes] + ["KiB per token"],
        rows,
        title="Temporary memory per device (memory_analysis): linear in the tokens per rank",
    )


if __name__ == "__main__":
    main()

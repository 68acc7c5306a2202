"""What context parallelism costs per rank: flops, bytes received, temporary memory.

Compiles the CP kernel (`chunk_gated_delta_rule_cp` inside `shard_map`, simulated CPU
devices) and the single-device kernel on one rank's share of the tokens, and reads XLA's
own accounting from the compiled modules:

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
from deltanet_cp import GatedDeltaRule  # noqa: E402
from deltanet_cp._engine import local_map  # noqa: E402


B, H, HV, D, C = 1, 4, 4, 128, 64


def inputs(t):
    shapes = [(B, t, H, D), (B, t, H, D), (B, t, HV, D), (B, t, HV), (B, t, HV)]
    return [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]


def single(q, k, v, g, beta):
    return dcp.chunk_gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, chunk_size=C
    )


def sharded(cp, strategy):
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P(None, "cp")

    def per_rank(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule_cp(
            q,
            k,
            v,
            g,
            beta,
            axis_name="cp",
            strategy=strategy,
            use_qk_l2norm=True,
            output_final_state=True,
            chunk_size=C,
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


def compile_single(fn, m):
    return jax.jit(fn).lower(*inputs(m * C)).compile()


def loop_corrected(fn, n):
    """Flops of `fn` (whose loops all run over the chunks) at `n` chunks, fit on 2 and 4."""
    f2, f4 = (raw_flops(compile_single(fn, m)) for m in (2, 4))
    per_item = (f4 - f2) / 2
    return (per_item + f2 - 2 * per_item) * n


def prepare_only(q, k, v, g, beta):
    return GatedDeltaRule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C).prepare()


def phase1_only(q, k, v, g, beta):
    rec = GatedDeltaRule(q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C)
    return local_map(rec, rec.prepare())


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
        cp_raw = raw_flops(sharded(cp, "allgather")(m * C * cp))
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
    for strategy in ["allgather", "ppermute", "ring"]:
        for cp in [2, 4, 8]:
            text = sharded(cp, strategy)(1024 * cp).as_text()
            got = max(dcp.received_bytes_per_rank(text).values(), default=0)
            expected = 4 * dcp.payload_elements(strategy, cp, B * HV, D, D, final_state=True)
            rows.append([strategy, cp, f"{got / 2**20:.3f}", f"{expected / 2**20:.3f}"])
    print_table(
        ["strategy", "cp", "MiB received per rank (HLO)", "payload_elements x 4 B"],
        rows,
        title="Phase-2 payload per rank, read from the compiled HLO (with the final state; the "
        "same at every sequence length)",
    )
    # 3. Temporary memory per device at several tokens per rank.
    sizes = [1024, 2048, 4096]
    rows = []
    for strategy in ["allgather", "ring"]:
        for cp in [2, 8]:
            lower = sharded(cp, strategy)
            temps = [lower(s * cp).memory_analysis().temp_size_in_bytes for s in sizes]
            rows.append(
                [strategy, cp]
                + [f"{t / 2**20:.1f}" for t in temps]
                + [f"{temps[-1] / sizes[-1] / 1024:.1f}"]
            )
    temps = [compile_single(single, s // C).memory_analysis().temp_size_in_bytes for s in sizes]
    rows.append(
        ["single device", 1]
        + [f"{t / 2**20:.1f}" for t in temps]
        + [f"{temps[-1] / sizes[-1] / 1024:.1f}"]
    )
    print_table(
        ["strategy", "cp"] + [f"temp MiB at S/cp = {s}" for s in sizes] + ["KiB per token"],
        rows,
        title="Temporary memory per device (memory_analysis): linear in the tokens per rank",
    )


if __name__ == "__main__":
    main()

"""What the zigzag layout costs a recurrence: contiguous vs zigzag shards, per rank.

A hybrid model runs its Gated DeltaNet layers on the zigzag shards its attention layers want.
A recurrence gains nothing from the balance (its work per rank is the same under either
layout), and a zigzag shard is two walks over the ranks instead of one. This prints, for
`chunk_gated_delta_rule(..., cp=ContextParallel(...))` inside `shard_map` over `cp` simulated
CPU devices, each exchange and both layouts:

- bytes received by the busiest rank, forward and forward + backward, read from the compiled
  HLO (`deltanet_cp.received_bytes_per_rank`), beside the forward formula
  (`exchange.payload_elements(..., layout=...)`, 4 bytes an element);
- temporary memory per device, `memory_analysis()`, in KiB per local token, forward and
  forward + backward;
- wall time of forward + backward, zigzag over contiguous, paired: both run alternately in
  the same rounds and the ratio is the median of the per-round ratios (simulated devices
  share the machine's cores, so this is total work, not a multi-host step time).

    python benchmarks/zigzag_cost.py            # T = 4096, cp = 4 (about 3 minutes)
    python benchmarks/zigzag_cost.py --quick    # T = 1024, cp = 4, fewer rounds
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()


import argparse  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import gdn_inputs, machine_line, paired_ratio, paired_times, print_table  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402


B, H, HV, D, C = 1, 4, 4, 128, 64
EXCHANGES = {"allgather": dcp.AllGather(), "ppermute": dcp.PPermute(), "ring": dcp.Ring()}
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}


def programs(cp: int, exchange, layout):
    """Jitted forward and forward + backward over a `cp`-device mesh, on arrays already in
    the layout's order (as a training loop keeps them)."""
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    seq = P(None, "cp")
    parallel = dcp.ContextParallel("cp", layout=layout, exchange=exchange)

    def per_rank(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, chunk_size=C, cp=parallel
        )

    forward = jax.shard_map(per_rank, mesh=mesh, in_specs=(seq,) * 5, out_specs=(seq, P()))

    def loss(*args):
        o, h = forward(*args)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(h * h)

    return mesh, jax.jit(forward), jax.jit(jax.grad(loss, argnums=tuple(range(5))))


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t, cp, rounds = (1024, 4, 3) if args.quick else (4096, 4, 5)
    print(f"jax {jax.__version__}; {machine_line()}")
    print(f"B={B}, H=HV={H}, K=V={D}, chunk {C}, float32, T={t}, cp={cp} ({t // cp} tokens/rank)")
    data = gdn_inputs(np.random.default_rng(0), B, t, H, HV, D)
    rows, calls = [], {}
    for ex_name, exchange in EXCHANGES.items():
        for lay_name, layout in LAYOUTS.items():
            mesh, fwd, grad = programs(cp, exchange, layout)
            shard = NamedSharding(mesh, P(None, "cp"))
            placed = [jax.device_put(x, shard) for x in data]
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard) for x in data]
            compiled = [f.lower(*specs).compile() for f in (fwd, grad)]
            received = []
            for c in compiled:
                per_rank = dcp.received_bytes_per_rank(c.as_text() or "")
                received.append(max(per_rank.values(), default=0))
            formula = 4 * exchange.payload_elements(
                cp,
                map_elements=B * HV * D * (D + D),
                state_elements=B * HV * D * D,
                final_state=True,
                layout=layout,
            )
            temps = [c.memory_analysis().temp_size_in_bytes / 1024 / (t // cp) for c in compiled]
            rows.append(
                [
                    ex_name,
                    lay_name,
                    f"{received[0] / 2**20:.2f}",
                    f"{formula / 2**20:.2f}",
                    f"{received[1] / 2**20:.2f}",
                    f"{temps[0]:.1f}",
                    f"{temps[1]:.1f}",
                ]
            )

            def call(grad=grad, placed=placed):
                jax.block_until_ready(grad(*placed))

            call()  # warm up
            calls[(ex_name, lay_name)] = call
    print_table(
        [
            "exchange",
            "layout",
            "fwd MiB recv (HLO)",
            "fwd formula",
            "fwd+bwd MiB recv",
            "fwd KiB/token",
            "fwd+bwd KiB/token",
        ],
        rows,
        title="Per rank, with the global final state:",
    )
    times = paired_times({f"{k[0]} {k[1]}": v for k, v in calls.items()}, rounds)
    ratio_rows = []
    for ex_name in EXCHANGES:
        zig, con = times[f"{ex_name} zigzag"], times[f"{ex_name} contiguous"]
        ratio_rows.append(
            [
                ex_name,
                f"{np.median(con):.3f}",
                f"{np.median(zig):.3f}",
                f"{paired_ratio(zig, con):.2f}",
            ]
        )
    print_table(
        ["exchange", "contiguous s", "zigzag s", "zigzag / contiguous (paired median)"],
        ratio_rows,
        title=f"Forward + backward wall time, {rounds} paired rounds:",
    )
    print(f"\n{machine_line()}")


if __name__ == "__main__":
    main()

"""What an unused final state costs under context parallelism: bytes received per rank.

Our functions always return the final state; a caller who ignores it should pay nothing
for it. This compiles, over 4 simulated devices, a loss of the outputs only (the final
state returned and left unused) and its gradient, for every exchange and layout, and prints
the bytes the busiest rank receives (`deltanet_cp.received_bytes_per_rank` of the compiled
HLO) and the number of collectives. Nothing is executed.

Run it on two trees to compare (`PYTHONPATH=<tree> python benchmarks/final_state.py`): a
tree from before `ContextParallel` (whose `chunk_gated_delta_rule_cp` formed the final state
only with `output_final_state=True`) is called without it.
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402


B, T, H, HV, K, V = 1, 256, 1, 2, 16, 8


def main():
    current = hasattr(dcp, "ContextParallel")
    keys = jax.random.split(jax.random.key(0), 5)
    args = (
        jax.random.normal(keys[0], (B, T, H, K)),
        jax.random.normal(keys[1], (B, T, H, K)),
        jax.random.normal(keys[2], (B, T, HV, V)),
        -jax.nn.softplus(jax.random.normal(keys[3], (B, T, HV))),
        jax.nn.sigmoid(jax.random.normal(keys[4], (B, T, HV))),
    )
    mesh = jax.make_mesh((4,), ("cp",))
    seq = P(None, "cp")
    placed = jax.device_put(args, NamedSharding(mesh, seq))
    print(f"deltanet_cp from {os.path.dirname(dcp.__file__)}; B={B} T={T} HV={HV} K={K} V={V}")
    print("| exchange | layout | fwd bytes | fwd collectives | grad bytes | grad collectives |")
    print("|---|---|---|---|---|---|")
    for exchange in ["allgather", "ppermute", "ring"]:
        for layout in [dcp.Contiguous(), dcp.Zigzag()]:

            def per_rank(*a, exchange=exchange, layout=layout):
                if current:
                    cp = dcp.ContextParallel("cp", exchange=exchange, layout=layout)
                    o, _ = dcp.chunk_gated_delta_rule(*a, chunk_size=16, cp=cp)
                else:
                    o, _ = dcp.chunk_gated_delta_rule_cp(  # pyright: ignore
                        *a, chunk_size=16, axis_name="cp", exchange=exchange, layout=layout
                    )
                return jax.lax.psum(jnp.sum(o**2), "cp")

            def loss(*a, per_rank=per_rank):
                specs = (seq,) * len(a)
                return jax.shard_map(per_rank, mesh=mesh, in_specs=specs, out_specs=P())(*a)

            row = [exchange, type(layout).__name__]
            for fn in [loss, jax.grad(loss, argnums=tuple(range(len(args))))]:
                text = jax.jit(fn).lower(*placed).compile().as_text() or ""
                row += [
                    f"{max(dcp.received_bytes_per_rank(text).values(), default=0):,}",
                    str(len(dcp.collectives(text))),
                ]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()

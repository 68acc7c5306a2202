"""One process of the multi-process test (tests/test_multiprocess.py); not collected by pytest.

Usage: python _multiprocess_worker.py PORT NUM_PROCESSES PROCESS_ID OUT_FILE
Each process owns 2 simulated CPU devices; together they form one context-parallel mesh.
"""

import os
import sys


os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


def main():
    port, nproc, pid, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=nproc,
        process_id=pid,
        initialization_timeout=60,
    )
    import deltanet_cp as dcp

    cp = jax.device_count()
    # The same inputs in every process (seeded), global shape.
    rng = np.random.default_rng(0)
    b, t, h, hv, dk, dv = 1, 32 * cp, 1, 2, 8, 4
    q = rng.standard_normal((b, t, h, dk), np.float32)
    k = (0.7 * rng.standard_normal((b, t, h, dk)) / np.sqrt(dk)).astype(np.float32)
    v = rng.standard_normal((b, t, hv, dv), np.float32)
    g = -np.exp(rng.uniform(-5, 0, (b, t, hv))).astype(np.float32)
    beta = rng.uniform(0, 1, (b, t, hv)).astype(np.float32)
    h0 = rng.standard_normal((b, hv, dk, dv), np.float32)

    mesh = jax.make_mesh((cp,), ("cp",))
    seq = NamedSharding(mesh, P(None, "cp"))
    rep = NamedSharding(mesh, P())

    def put(x, sharding):
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    args = [put(x, seq) for x in (q, k, v, g, beta)] + [put(h0, rep)]

    def per_rank(q, k, v, g, beta, h0):
        return dcp.chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=h0,
            chunk_size=16,
            cp=dcp.ContextParallel("cp", exchange="ppermute"),
        )

    fn = jax.jit(
        jax.shard_map(
            per_rank,
            mesh=mesh,
            in_specs=(P(None, "cp"),) * 5 + (P(),),
            out_specs=(P(None, "cp"), P()),
        )
    )
    o, hf = fn(*args)
    o = multihost_utils.process_allgather(o, tiled=True)
    hf = multihost_utils.process_allgather(hf, tiled=True)
    local = jax.local_devices()[0]
    with jax.default_device(local):
        ref_o, ref_h = dcp.chunk_gated_delta_rule(
            *(jnp.asarray(x) for x in (q, k, v, g, beta)),
            initial_state=jnp.asarray(h0),
            chunk_size=16,
        )
    err_o = float(np.max(np.abs(np.asarray(o) - np.asarray(ref_o))) / np.max(np.abs(ref_o)))
    err_h = float(np.max(np.abs(np.asarray(hf) - np.asarray(ref_h))) / np.max(np.abs(ref_h)))
    with open(out, "w") as f:
        f.write(f"{cp} {jax.process_count()} {err_o} {err_h}\n")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

"""One process of the multi-process test (tests/test_multiprocess.py); not collected by pytest.

Usage: python -m tests._multiprocess_worker PORT NUM_PROCESSES PROCESS_ID OUT_DIR
Each process owns 2 simulated CPU devices (`tests._processes.run_workers`); together they form
one context-parallel mesh.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _processes


def main():
    (folder,) = _processes.join()
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
    with open(os.path.join(folder, f"out{jax.process_index()}.txt"), "w") as f:
        f.write(f"{cp} {jax.process_count()} {err_o} {err_h}\n")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

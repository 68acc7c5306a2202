"""One process of the two-process `save_pretrained` test (tests/test_save_pretrained.py); not
collected by pytest.

Usage: python -m tests._save_worker PORT NUM_PROCESSES PROCESS_ID FIXTURE OUT_DIR
Each process owns 2 simulated CPU devices (`tests._processes.run_workers`); the fixture's
parameters are split over the 4 of them (the first axis divisible by 4, else replicated) and
saved to OUT_DIR.
"""

import os

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from . import _processes


def main():
    fixture, out = _processes.join()
    from deltanet_cp.models import Qwen3_5MoeForCausalLM

    model = Qwen3_5MoeForCausalLM.from_pretrained(fixture)
    mesh = jax.make_mesh((jax.device_count(),), ("x",))

    def put(x):
        if not eqx.is_array(x):
            return x
        x = np.asarray(x)
        axis = next((i for i, n in enumerate(x.shape) if n % 4 == 0), None)
        spec: list[str | None] = [None] * x.ndim
        if axis is not None:
            spec[axis] = "x"
        sharding = NamedSharding(mesh, P(*spec))
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    sharded = jax.tree.map(put, model)
    leaves = [x for x in jax.tree.leaves(sharded) if eqx.is_array(x)]
    assert not any(x.is_fully_addressable for x in leaves)
    sharded.save_pretrained(out, max_shard_size=20_000)
    # Every process returns once the files are in place.
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

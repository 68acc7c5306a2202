import gc
import os


# Simulated devices for context parallelism; must be set before jax is imported. The YNNPACK
# fusion of jaxlib 0.10.2's CPU backend crashes on some gradients of the layer (a segfault
# inside XLA, seen with eqx.filter_jit), so it is switched off here as in examples/demo.py.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type="
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop every compiled program after each test.

    Each CPU executable keeps its JIT-compiled code in its own memory mappings. Over the whole
    slow suite one process accumulates more than Linux's default `vm.max_map_count` (65530), and
    the next compilation then segfaults inside XLA. Clearing JAX's caches lets the executables,
    and their mappings, be freed.
    """
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def getkey():
    """A fresh PRNG key on each call, seeded per test."""
    key = jr.key(5678)

    def _getkey():
        nonlocal key
        key, sub = jr.split(key)
        return sub

    return _getkey


@pytest.fixture
def without_runtime_typecheck():
    """Turn off jaxtyping's runtime checks, to see the errors a user gets without them."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)

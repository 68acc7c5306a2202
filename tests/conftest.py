import gc
import os


# Simulated devices for context parallelism; must be set before jax is imported. XLA's other
# defaults stay as users have them (its YNNPACK fusions included: tests/test_default_flags.py).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402

from tests import _compile_cache, _compile_stats  # noqa: E402
from tests._fast_compile import fast_compiling  # noqa: E402


_compile_cache.enable()


def pytest_addoption(parser):
    parser.addoption(
        "--suite-profile",
        metavar="DIR",
        default=None,
        help="write each test's wall and XLA compile seconds to DIR/<worker>.jsonl "
        "(python -m tests.profile_report DIR prints the tables)",
    )


def pytest_configure(config):
    config.pluginmanager.register(_compile_stats, "compile_stats")


jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")


def _memory_mappings() -> tuple[int, int] | None:
    """This process's memory mappings and the kernel's limit on them (None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except OSError:
        return None


@pytest.fixture(autouse=True)
def _free_compiled_programs():
    """Drop JAX's compiled programs once they hold a third of the memory-mapping limit.

    Each CPU executable keeps its JIT-compiled code in its own memory mappings. Over the whole
    slow suite one process accumulates more than Linux's default `vm.max_map_count` (65530), and
    the next compilation then segfaults inside XLA. Clearing JAX's caches lets the executables,
    and their mappings, be freed; doing it only past a threshold keeps the programs that later
    tests of a module reuse.
    """
    yield
    mappings = _memory_mappings()
    if mappings is not None and 3 * mappings[0] > mappings[1]:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="session")
def _small_blocks():
    """Blocks of two chunks (at the suite's chunk size of 8) for every test that does not pick
    its own `block_size`, so the loop over blocks, the padding of the last block and the
    carries between blocks are exercised everywhere; tests/test_recurrences.py checks one
    block and other sizes explicitly."""
    from deltanet_cp import _run

    saved = dict(_run._DEFAULT_BLOCK_SIZE)
    _run._DEFAULT_BLOCK_SIZE.update({k: 16 for k in saved})
    yield
    _run._DEFAULT_BLOCK_SIZE.update(saved)


@pytest.fixture(scope="module")
def fast_compile():
    """`fast_compiling` for a module whose tests are dominated by compiling small programs
    (it changes nothing there beyond rounding); the other modules compile as users do
    (tests/README.md lists what keeps XLA's defaults)."""
    with fast_compiling():
        yield


@pytest.fixture
def fast_compile_one_test():
    """`fast_compiling` for one test of a module whose other tests compile as users do: its
    heavy programs that check our code against our own (context parallelism against one
    device, a training step), where the module's other tests check the defaults."""
    with fast_compiling():
        yield


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

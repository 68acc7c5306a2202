"""The suite's persistent compilation cache: each XLA program compiled once per checkout.

XLA:CPU compiling small programs is most of the suite's time. JAX's persistent cache keeps
every compiled program in `.cache/jax` at the repository's root (`make clean` removes it), so
the test processes share what they compile, the slow run reuses the default run's programs
and a second `make test` loads instead of compiling. The key covers the program, the XLA
flags, the devices and the versions of jax and jaxlib: a changed program or flag compiles
anew, and it never changes a result.

`enable()` turns it on in this process (the suite's conftest, and the subprocess that runs
the docs pages). `JAX_COMPILATION_CACHE_DIR` set by the caller wins; `DELTANET_CP_TEST_CACHE=0`
turns the cache off (to time the suite without it).

JAX writes a cache entry in place (`Path.write_bytes`), so a process reading an entry that
another is still writing (two test workers, the same program) reads a truncated entry: a
warning and a compilation, and an entry written twice at once can be left corrupt for good.
`enable()` makes the write atomic (a temporary file, then `os.replace`); tests/test_fixtures.py
checks it.
"""

import os
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".cache" / "jax"


def directory() -> str | None:
    """Where the cache lives, or None where it is off."""
    if os.environ.get("DELTANET_CP_TEST_CACHE", "1") == "0":
        return None
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(DEFAULT_DIR)


def _atomic_put(self, key: str, value: bytes) -> None:
    from jax._src import lru_cache

    if self.eviction_enabled:  # JAX's own file lock serialises readers and writers
        assert _ORIGINAL_PUT is not None
        return _ORIGINAL_PUT(self, key, value)
    path = self.path / f"{key}{lru_cache._CACHE_SUFFIX}"
    if path.exists():
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(value)
    os.replace(partial, path)


_ORIGINAL_PUT = None


def enable() -> str | None:
    """Turn the persistent cache on for every program this process compiles; its directory."""
    global _ORIGINAL_PUT
    import jax
    from jax._src import lru_cache

    path = directory()
    if path is None:
        return None
    if _ORIGINAL_PUT is None:
        _ORIGINAL_PUT = lru_cache.LRUCache.put
        lru_cache.LRUCache.put = _atomic_put
    jax.config.update("jax_compilation_cache_dir", path)
    # Every program, however small or quick to compile: loading one is cheaper still.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path

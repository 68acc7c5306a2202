"""The suite's own tools: the persistent compilation cache and the profile report.

Cheap: no program is compiled here beyond scalar functions (about 2 s in all).
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
from jax._src import compilation_cache, lru_cache

from . import _compile_cache, _fast_compile, profile_report


def test_the_suite_runs_with_the_persistent_cache():
    path = _compile_cache.directory()
    if path is None:  # DELTANET_CP_TEST_CACHE=0: timing the suite without it
        assert not getattr(jax.config, "jax_compilation_cache_dir")
        return
    assert getattr(jax.config, "jax_compilation_cache_dir") == path
    assert getattr(jax.config, "jax_persistent_cache_min_compile_time_secs") == 0.0
    # A program compiled here is in the cache, under JAX's name for it.
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.float32(0.25)).block_until_ready()
    assert compilation_cache.is_cache_used(jax.devices()[0].client)
    assert any(name.endswith("-cache") for name in os.listdir(path))


def test_cache_entries_are_written_whole(tmp_path):
    # What a second process sees while an entry is being written: nothing, or all of it.
    # The write goes to a file of its own and is renamed into place.
    cache = lru_cache.LRUCache(str(tmp_path), max_size=-1)
    assert lru_cache.LRUCache.put is _compile_cache._atomic_put
    seen = []
    original = os.replace

    def replace(src, dst):
        seen.append((sorted(os.listdir(tmp_path)), os.path.getsize(src)))
        original(src, dst)

    try:
        os.replace = replace
        cache.put("key", b"x" * 1000)
        cache.put("key", b"y" * 10)  # present: left as it is, as JAX does
    finally:
        os.replace = original
    [(listing, size)] = seen
    assert listing == [f"key-cache.{os.getpid()}.partial"] and size == 1000
    assert sorted(os.listdir(tmp_path)) == ["key-cache"]
    assert cache.get("key") == b"x" * 1000


def test_profile_report_tables(tmp_path, capsys):
    records = [
        {"test": "tests/test_a.py::test_one", "wall_s": 3.0, "backend_s": 2.0, "compiles": 4},
        {"test": "tests/test_a.py::test_two[x]", "wall_s": 1.0, "trace_s": 0.5},
        {
            "test": "tests/test_b.py::test_three",
            "wall_s": 0.5,
            "cache_requests": 2,
            "cache_hits": 1,
        },
    ]
    (tmp_path / "gw0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    profile_report.main([str(tmp_path), "--slowest", "2"])
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert lines[1].split() == ["test_a.py", "2", "4.0", "2.5", "62", "4"]
    assert lines[2].split() == ["test_b.py", "1", "0.5", "0.0", "0", "0"]
    assert "the 2 slowest tests" in stdout
    assert lines[-1].startswith("3 tests, 4 s summed") and "hits 1 of 2 (50%)" in lines[-1]


def test_fast_compiling_reaches_the_compiler():
    # The options `fast_compiling` adds are in the compile options JAX builds for every
    # program (by the function it calls for them; were it renamed, this fails instead of the
    # suite silently compiling at the defaults' cost), and only inside the block.
    from jax._src import compiler
    from jax._src.interpreters import pxla

    assert "compiler.get_compile_options(" in pathlib.Path(pxla.__file__).read_text()

    def overrides():
        options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
        return dict(options.env_option_overrides)

    with _fast_compile.fast_compiling():
        assert jax.config.read("jax_disable_most_optimizations")
        assert overrides().items() >= _fast_compile.FAST_COMPILE_OPTIONS.items()
    assert not overrides().keys() & _fast_compile.FAST_COMPILE_OPTIONS.keys()


def test_nothing_compiled_fast_is_reused_after_the_block():
    # A jitted function first compiled inside `fast_compiling` compiles again after it (at the
    # defaults), instead of being served from JAX's in-memory caches, which do not key on
    # the options. One scalar function, compiled twice.
    compiles = []

    @jax.jit
    def f(x):
        compiles.append(jax.config.read("jax_disable_most_optimizations"))
        return x * 5.0 - 2.0

    with _fast_compile.fast_compiling():
        f(jnp.float32(1.5)).block_until_ready()
        f(jnp.float32(2.5)).block_until_ready()
    f(jnp.float32(1.5)).block_until_ready()
    assert compiles == [True, False]

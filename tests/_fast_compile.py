"""Compiling the suite's small programs quickly: `fast_compiling()`.

Most test modules are dominated by XLA:CPU compiling many small programs. Inside
`fast_compiling()` (tests/conftest.py's fixtures: `fast_compile` for a module,
`fast_compile_one_test` for one test) XLA compiles with its most optimisations off
(`jax_disable_most_optimizations`) and with the elemental emitters in place of the MLIR
fusion emitters: the same arithmetic, up to rounding, in about a third of the time of the
defaults (measured: 1.4 s -> 0.4 s for a cp = 4 zigzag Gated
DeltaNet gradient). What users run compiles under the defaults: tests/README.md lists it.
"""

import contextlib

import jax


# What `fast_compiling` asks of XLA:CPU besides `jax_disable_most_optimizations`: the
# elemental emitters in place of the MLIR fusion emitters, which take under half the time to
# compile this suite's small programs (measured: 28 s -> 12 s of compiling over 20 CP-gradient
# tests) and compute the same elementwise arithmetic. Passed as compile options, so they are
# part of the persistent cache's key.
FAST_COMPILE_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@contextlib.contextmanager
def fast_compiling():
    """XLA's most optimisations off, and its quicker-to-compile emitters on, inside the block;
    nothing compiled inside it is reused after it."""
    from jax._src import compiler

    get_compile_options = compiler.get_compile_options

    def with_fast_options(*args, env_options_overrides=None, **kwargs):
        overrides = {**FAST_COMPILE_OPTIONS, **(env_options_overrides or {})}
        return get_compile_options(*args, env_options_overrides=overrides, **kwargs)

    previous = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    compiler.get_compile_options = with_fast_options
    try:
        yield
    finally:
        compiler.get_compile_options = get_compile_options
        jax.config.update("jax_disable_most_optimizations", previous)
        # JAX's in-memory caches of traced and compiled functions do not key on these
        # options: a jitted function compiled inside the block would be reused as it is by
        # the tests after it (a module that keeps the defaults, or the rest of the module of
        # a `fast_compile_one_test`). Emptied, they compile again at the defaults (or load
        # from the persistent cache, whose key holds the options).
        jax.clear_caches()

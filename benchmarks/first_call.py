"""Calling the kernels outside `jax.jit`: the cost of the first call and of the next ones.

The engine entry behind every `chunk_*` function (`deltanet_cp.run`, which calls the
private `deltanet_cp._engine._run`) is wrapped in `equinox.filter_jit`, so an eager call
compiles the whole pass once per input shape.
For each chunked kernel, at a small shape (B=1, T=200, H=2, HV=4, K=16, V=8, chunk 64),
this prints the wall time of the first and of a repeated call:

- eager, as shipped;
- eager with that wrapper removed (what an eager call cost before: the preparation runs
  operation by operation, each operation compiled on first use);
- inside the caller's own `jax.jit`.

Each column uses its own sequence length (200, 201, 202) so that no compiled function is
shared between columns.

    python benchmarks/first_call.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from _common import machine_line, print_table

import deltanet_cp as dcp
import deltanet_cp._engine as engine


B, H, HV, K, V = 1, 2, 4, 16, 8


def inputs(kind: str, t: int, rng) -> list:
    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32))

    def gate(*shape):
        return jnp.asarray(-np.log1p(np.exp(rng.standard_normal(shape))).astype(np.float32))

    def unit(*shape):
        return jnp.asarray((1 / (1 + np.exp(-rng.standard_normal(shape)))).astype(np.float32))

    q, k, v = normal(B, t, H, K), normal(B, t, H, K), normal(B, t, HV, V)
    if kind == "gdn":
        return [q, k, v, gate(B, t, HV), unit(B, t, HV)]
    if kind == "delta":
        return [q, k, v, unit(B, t, HV)]
    if kind == "kda":
        return [q, k, v, gate(B, t, HV, K), unit(B, t, HV)]
    if kind == "gla":
        return [q, k, v, gate(B, t, HV, K)]
    n_h = 2
    return [
        q,
        normal(B, t, n_h, H, K),
        normal(B, t, n_h, HV, V),
        gate(B, t, HV),
        unit(B, t, n_h, HV),
    ]


KERNELS = [
    ("chunk_gated_delta_rule", dcp.chunk_gated_delta_rule, "gdn"),
    ("chunk_delta_rule", dcp.chunk_delta_rule, "delta"),
    ("chunk_kimi_delta_attention", dcp.chunk_kimi_delta_attention, "kda"),
    ("chunk_gla", dcp.chunk_gla, "gla"),
    ("chunk_gated_delta_product", dcp.chunk_gated_delta_product, "product"),
]


def two_calls(fn, args) -> tuple[float, float]:
    times = []
    for _ in range(2):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times[0], times[1]


def main():
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__} on {jax.default_backend()}; {machine_line()}")
    shipped = engine._run
    # The function `eqx.filter_jit` wraps (its `_JitWrapper` has a `__wrapped__` property).
    unwrapped = shipped.__wrapped__  # pyright: ignore[reportFunctionMemberAccess]
    rows = []
    for name, fn, kind in KERNELS:

        def call(*args, fn=fn):
            return fn(*args, output_final_state=True)[0]

        eager = two_calls(call, inputs(kind, 200, rng))
        engine._run = unwrapped  # the global that `deltanet_cp.run` looks up at each call
        try:
            op_by_op = two_calls(call, inputs(kind, 201, rng))
        finally:
            engine._run = shipped
        jitted = two_calls(jax.jit(call), inputs(kind, 202, rng))
        rows.append(
            [name]
            + [f"{eager[0]:.2f}", f"{eager[1] * 1e3:.1f}"]
            + [f"{op_by_op[0]:.2f}", f"{op_by_op[1] * 1e3:.1f}"]
            + [f"{jitted[0]:.2f}", f"{jitted[1] * 1e3:.1f}"]
            + [f"{op_by_op[0] / eager[0]:.1f}x"]
        )
    print_table(
        [
            "kernel",
            "eager: first call s",
            "next call ms",
            "op by op: first call s",
            "next call ms",
            "in your jit: first call s",
            "next call ms",
            "first call, op by op / eager",
        ],
        rows,
        title=f"First and repeated calls at B={B}, T=200, H={H}, HV={HV}, K={K}, V={V}",
    )


if __name__ == "__main__":
    main()

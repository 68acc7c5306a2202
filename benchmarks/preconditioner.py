"""What the preconditioned rules' first stage costs, and a second design for it.

`chunk_precond_kda` and `chunk_precond_gated_delta_rule` run two recurrences: a diagonal
preconditioner per key head, `A_t = exp(g_atk_t) A_{t-1} + beta_atk_t k_t^2` (elementwise
over K), squashed into a write-key scale, then the delta rule. The library runs the
preconditioner on the engine, as gated linear attention with a one-row state (so context
parallelism, packed documents and its VJP come from the engine). The other design here is
the elementwise recurrence as a `jax.lax.associative_scan` over time on one device, autodiff
for its VJP. Both end in the library's squash; both are exact up to float32 rounding.

At Qwen3-Next-like heads (B = 1, T = 2048, H = 16, HV = 32, K = V = 128, float32, chunk 64,
q/k L2 norm), interleaved in one process (A/B/A/B): the stage alone, forward+backward (the
gradient of a fixed weighting of the write keys, to `k`, `g_atk` and `beta_atk`), beside the
whole preconditioned KDA training step and KDA's (the same step without the stage), so the
stage's share of the step is read off one run.

    python benchmarks/preconditioner.py            # about a minute on 2 cores
    python benchmarks/preconditioner.py --quick    # a smoke test
"""

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import machine_line, paired_ratio, paired_times, print_table  # noqa: E402
from _impls import _family_inputs  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp.chunkops import l2norm  # noqa: E402
from deltanet_cp.recurrences._cascade import engine_stage, precondition, squash  # noqa: E402


X, EPS = 1.5, 1e-6  # chunk_precond_kda's defaults


def on_engine(k, g_atk, beta_atk):
    """The library's stage: the preconditioner on the engine, then the squash."""
    keys, _, _ = precondition(
        k,
        g_atk,
        beta_atk,
        dtype=jnp.float32,
        use_qk_l2norm=True,
        initial_A_state=None,
        chunk_size=64,
        precision="highest",
        x=X,
        eps=EPS,
        log_atk_scale=None,
        stage=engine_stage(None, None, None),
    )
    return keys


def associative(k, g_atk, beta_atk):
    """The same stage with the elementwise recurrence as an associative scan over time."""
    k_erase = l2norm(k)
    decay = jnp.broadcast_to(jnp.exp(g_atk)[..., None], k_erase.shape)
    writes = beta_atk[..., None] * k_erase**2

    def combine(first, second):  # (a1, x1) then (a2, x2): h -> a2 (a1 h + x1) + x2
        return first[0] * second[0], second[0] * first[1] + second[1]

    _, a = jax.lax.associative_scan(combine, (decay, writes), axis=1)
    return squash(k_erase, a, x=X, eps=EPS, log_atk_scale=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="T = 256, 4 heads, 3 rounds")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    b, t, h, hv, d = (1, 256, 2, 4, 32) if args.quick else (1, 2048, 16, 32, 128)
    rounds = 3 if args.quick else args.rounds
    pre = [jnp.asarray(x) for x in _family_inputs("precond_kda", b, t, h, hv, d)]
    q, k, v, g, g_atk, beta_atk, beta = pre
    weight = jnp.asarray(np.random.default_rng(1).standard_normal(k.shape), jnp.float32)

    def stage_grad(stage):
        return jax.grad(lambda *a: jnp.sum(stage(*a) * weight), argnums=(0, 1, 2))

    def step(fn, count: int):  # fwd+bwd of (o, final state) to all `count` inputs
        def loss(*a):
            o, s = fn(*a, use_qk_l2norm=True, chunk_size=64)[:2]
            return jnp.sum(o * o) + jnp.sum(s)

        return jax.grad(loss, argnums=tuple(range(count)))

    variants = {
        "stage on the engine (the library)": (stage_grad(on_engine), (k, g_atk, beta_atk)),
        "stage as an associative scan": (stage_grad(associative), (k, g_atk, beta_atk)),
        "preconditioned KDA, whole step": (step(dcp.chunk_precond_kda, 7), tuple(pre)),
        "KDA, whole step": (step(dcp.chunk_kda, 5), (q, k, v, g, beta)),
    }
    keys = [jax.jit(f)(k, g_atk, beta_atk) for f in (on_engine, associative)]
    diff = jnp.max(jnp.abs(keys[0] - keys[1]))
    calls = {}
    for name, (fn, inputs) in variants.items():
        compiled = jax.jit(fn).lower(*inputs).compile()
        jax.block_until_ready(compiled(*inputs))
        calls[name] = lambda compiled=compiled, inputs=inputs: jax.block_until_ready(
            compiled(*inputs)
        )
    times = paired_times(calls, rounds)
    print(machine_line())
    whole = times["preconditioned KDA, whole step"]
    rows = [
        [name, f"{statistics.median(ts) * 1e3:.1f}", f"{paired_ratio(ts, whole):.2f}"]
        for name, ts in times.items()
    ]
    print_table(
        ["fwd+bwd", "ms", "of preconditioned KDA's step"],
        rows,
        title=(
            f"B = {b}, T = {t}, H = {h}, HV = {hv}, K = V = {d}, float32, chunk 64; {rounds} "
            f"rounds; the two stages' write keys differ by at most {float(diff):.1e}"
        ),
    )


if __name__ == "__main__":
    main()

"""Our chunked gated delta rule vs Hugging Face transformers' reference, on the same CPU.

Runs `deltanet_cp.chunk_gated_delta_rule` (JAX, jitted) and transformers'
`torch_chunk_gated_delta_rule` (PyTorch, eager; the raw function, not the hub-kernel
wrapper) on the same float32 inputs, forward and forward+backward, interleaved round by
round so both see the same machine load. Prints medians, the median of the paired ratios,
and achieved GFLOP/s (one flop count for both, see `_common.gdn_chunk_flops`) as a
fraction of each framework's own in-process float32 matmul rate, measured in the same
rounds. Ours runs twice: compiled with XLA's defaults (the headline numbers) and compiled
with XLA:CPU's YNNPACK fusions off for that one compile
(`compiler_options={"xla_cpu_experimental_ynn_fusion_type": ""}`, see
`benchmarks/cpu_bound.py` for why it matters).

Needs torch and transformers (the benchmark environment of `make bench`, never a library
dependency).

    python benchmarks/vs_transformers.py [--repeats 7] [--quick]
"""

import argparse
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import torch
from _common import (
    gdn_chunk_flops,
    gdn_inputs,
    machine_line,
    NO_YNN,
    paired_ratio,
    paired_times,
    print_table,
)
from transformers.models.qwen3_next import modeling_qwen3_next

import deltanet_cp as dcp


# (heads label, B, T, H, HV, K = V, paired rounds). Transformers' forward+backward at the
# Qwen3-Next shape takes several seconds a call on 2 cores, hence fewer rounds there.
SHAPES = [
    ("H=HV=4", 1, 4096, 4, 4, 128, 7),
    ("Qwen3-Next heads: H=16, HV=32", 1, 2048, 16, 32, 128, 2),
]
CHUNK = 64
MATMUL = 1024


def reference():
    fn = modeling_qwen3_next.torch_chunk_gated_delta_rule
    # The hub-kernel decorator wraps the torch function (and drops unknown kwargs).
    return getattr(fn, "__wrapped__", fn)


def make_inputs(b, t, h, hv, d, seed=0):
    rng = np.random.default_rng(seed)
    inputs = gdn_inputs(rng, b, t, h, hv, d)
    wo = rng.standard_normal((b, t, hv, d), dtype=np.float32)  # loss weights
    wh = rng.standard_normal((b, hv, d, d), dtype=np.float32)
    return inputs, (wo, wh)


def ours(inputs, weights, compiler_options=None):
    args = [jnp.asarray(x) for x in inputs]
    wo, wh = (jnp.asarray(w) for w in weights)

    def forward(q, k, v, g, beta):
        return dcp.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True, chunk_size=CHUNK
        )

    def loss(*a):
        o, h = forward(*a)
        return jnp.sum(o * wo) + jnp.sum(h * wh)

    fwd = jax.jit(forward, compiler_options=compiler_options).lower(*args).compile()
    grad = jax.grad(loss, argnums=range(5))
    fwd_bwd = jax.jit(grad, compiler_options=compiler_options).lower(*args).compile()
    return (
        lambda: jax.block_until_ready(fwd(*args)),
        lambda: jax.block_until_ready(fwd_bwd(*args)),
        lambda: np.asarray(fwd(*args)[0]),
    )


def theirs(inputs, weights):
    fn = reference()
    args = [torch.from_numpy(x) for x in inputs]
    wo, wh = (torch.from_numpy(w) for w in weights)

    def forward(*a):
        return fn(*a, chunk_size=CHUNK, use_qk_l2norm_in_kernel=True, output_final_state=True)

    def fwd():
        with torch.no_grad():
            return forward(*args)

    def fwd_bwd():
        leaves = [x.clone().requires_grad_(True) for x in args]
        o, h = forward(*leaves)
        ((o * wo).sum() + (h * wh).sum()).backward()
        return [x.grad for x in leaves]

    return fwd, fwd_bwd, lambda: fwd()[0].numpy()


def matmuls():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((MATMUL, MATMUL), dtype=np.float32) for _ in range(2))
    ja, jb = jnp.asarray(a), jnp.asarray(b)
    jmm = jax.jit(lambda x, y: x @ y).lower(ja, jb).compile()
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)

    def torch_mm():
        with torch.no_grad():
            return ta @ tb

    return lambda: jax.block_until_ready(jmm(ja, jb)), torch_mm


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=None, help="paired rounds per shape")
    parser.add_argument("--quick", action="store_true", help="shorter sequences, 3 rounds")
    args = parser.parse_args()
    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    print(
        f"jax {jax.__version__} ({jax.default_backend()}, XLA's default thread pool, "
        f"{threads} cores) vs torch {torch.__version__} (torch.set_num_threads({threads})); "
        f"float32, chunk {CHUNK}, qk l2norm on"
    )
    print(f"machine before: {machine_line()}")
    jax_mm, torch_mm = matmuls()
    rows, cost_rows = [], []
    for heads, b, t, h, hv, d, rounds in SHAPES:
        rounds = 3 if args.quick else (args.repeats or rounds)
        if args.quick:
            t //= 4
        label = f"{heads}, T={t}"
        inputs, weights = make_inputs(b, t, h, hv, d)
        o_fwd, o_fb, o_out = ours(inputs, weights)
        n_fwd, n_fb, _ = ours(inputs, weights, NO_YNN)
        t_fwd, t_fb, t_out = theirs(inputs, weights)
        err = np.max(np.abs(o_out() - t_out())) / np.max(np.abs(t_out()))
        calls = {
            "ours fwd": o_fwd,
            "theirs fwd": t_fwd,
            "ours fwd+bwd": o_fb,
            "theirs fwd+bwd": t_fb,
            "no-YNNPACK fwd": n_fwd,
            "no-YNNPACK fwd+bwd": n_fb,
            "jax matmul": jax_mm,
            "torch matmul": torch_mm,
        }
        for name, call in calls.items():  # warm up (the parity check ran both forwards)
            if name != "theirs fwd+bwd":
                call()
        times = paired_times(calls, rounds)
        print(f"{label}: {rounds} rounds done; {machine_line()}", flush=True)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        mm_flops = 2 * MATMUL**3
        # Each framework's matmul rate, round by round: achieved flops over it is the
        # fraction of the roofline, with the round's load in both numerator and denominator.
        flops = gdn_chunk_flops(b, t, hv, d, d, CHUNK)
        for pass_name, mult in [("fwd", 1), ("fwd+bwd", 3)]:
            ours_t, theirs_t = times[f"ours {pass_name}"], times[f"theirs {pass_name}"]
            f = mult * flops
            ours_frac = statistics.median(
                (f / a) / (mm_flops / m) for a, m in zip(ours_t, times["jax matmul"])
            )
            theirs_frac = statistics.median(
                (f / a) / (mm_flops / m) for a, m in zip(theirs_t, times["torch matmul"])
            )
            rows.append(
                [
                    label,
                    pass_name,
                    f"{med[f'ours {pass_name}'] * 1e3:.1f}",
                    f"{med[f'theirs {pass_name}'] * 1e3:.1f}",
                    f"{paired_ratio(theirs_t, ours_t):.2f}x",
                    f"{f / med[f'ours {pass_name}'] / 1e9:.1f}",
                    f"{ours_frac:.0%}",
                    f"{f / med[f'theirs {pass_name}'] / 1e9:.1f}",
                    f"{theirs_frac:.0%}",
                    f"{med[f'no-YNNPACK {pass_name}'] * 1e3:.1f}",
                    f"{paired_ratio(theirs_t, times[f'no-YNNPACK {pass_name}']):.2f}x",
                ]
            )
        cost_rows.append(
            [
                label,
                rounds,
                f"{paired_ratio(times['ours fwd+bwd'], times['ours fwd']):.2f}",
                f"{paired_ratio(times['theirs fwd+bwd'], times['theirs fwd']):.2f}",
                f"{mm_flops / med['jax matmul'] / 1e9:.0f}",
                f"{mm_flops / med['torch matmul'] / 1e9:.0f}",
                f"{err:.1e}",
            ]
        )
    print_table(
        [
            "shape (B=1, K=V=128)",
            "pass",
            "ours ms",
            "transformers ms",
            "speedup",
            "ours GFLOP/s",
            "of JAX matmul",
            "transformers GFLOP/s",
            "of torch matmul",
            "ours ms, YNNPACK off",
            "speedup, YNNPACK off",
        ],
        rows,
        title="Chunked gated delta rule, float32: medians over paired rounds "
        "(speedup = median of per-round transformers/ours)",
    )
    print_table(
        [
            "shape",
            "paired rounds",
            "ours fwd+bwd / fwd",
            "transformers fwd+bwd / fwd",
            "JAX matmul GFLOP/s",
            "torch matmul GFLOP/s",
            "max rel. diff of outputs",
        ],
        cost_rows,
        title=f"Backward cost and the {MATMUL}x{MATMUL} float32 matmul rates of the same rounds",
    )
    print(
        "\nGFLOP/s count the chunked algorithm's matmul flops once for both (forward; "
        "forward+backward counted as 3x forward)."
    )
    print(f"machine after: {machine_line()}")


if __name__ == "__main__":
    main()

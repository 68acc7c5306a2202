"""Single-device kernel speed: chunked vs recurrent, forward and forward+backward.

Prints time per call, tokens/s, achieved GFLOP/s (XLA cost analysis, corrected for loops)
and that as a fraction of this process's float32 matmul rate.

    python benchmarks/kernel_speed.py [--seq 4096] [--heads 4] [--dim 128]
"""

import argparse
import functools as ft

import jax
import jax.numpy as jnp
import jax.random as jr
from _common import loop_aware_flops, matmul_rate, median_time, print_table

import deltanet_cp as dcp


def make_inputs(b, t, h, hv, dk, dv):
    ks = jr.split(jr.key(0), 5)
    q = jr.normal(ks[0], (b, t, h, dk))
    k = jr.normal(ks[1], (b, t, h, dk))
    v = jr.normal(ks[2], (b, t, hv, dv))
    g = -jax.nn.softplus(jr.normal(ks[3], (b, t, hv)))
    beta = jax.nn.sigmoid(jr.normal(ks[4], (b, t, hv)))
    return q, k, v, g, beta


def forward(kernel, q, k, v, g, beta):
    o, h = kernel(q, k, v, g, beta, use_qk_l2norm=True, output_final_state=True)
    return o, h


def forward_backward(kernel, q, k, v, g, beta):
    def loss(q, k, v, g, beta):
        o, h = forward(kernel, q, k, v, g, beta)
        return jnp.sum(o * o) + jnp.sum(h * h)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--value-heads", type=int, default=None)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    args = parser.parse_args()
    b, t, h, d, c = args.batch, args.seq, args.heads, args.dim, args.chunk
    hv = args.value_heads or h
    rate = matmul_rate()
    print(f"backend {jax.default_backend()}, f32 matmul rate {rate / 1e9:.1f} GFLOP/s")
    kernels = {
        "chunked": ft.partial(dcp.chunk_gated_delta_rule, chunk_size=c),
        "recurrent": dcp.recurrent_gated_delta_rule,
    }
    rows = []
    for pass_name, wrap in [("forward", forward), ("forward+backward", forward_backward)]:
        for name, kernel in kernels.items():
            fn = jax.jit(ft.partial(wrap, kernel))
            x = make_inputs(b, t, h, hv, d, d)
            seconds = median_time(fn, *x, repeats=5)
            step = c if name == "chunked" else 1
            flops = loop_aware_flops(
                lambda m: make_inputs(b, m * step, h, hv, d, d),
                ft.partial(wrap, kernel),
                2,
                4,
                -(-t // step),
            )
            rows.append(
                [
                    pass_name,
                    name,
                    f"{seconds * 1e3:.1f}",
                    f"{b * t / seconds:,.0f}",
                    f"{flops / seconds / 1e9:.1f}",
                    f"{flops / seconds / rate:.1%}",
                ]
            )
    print_table(
        ["pass", "kernel", "ms/call", "tokens/s", "GFLOP/s", "of matmul rate"],
        rows,
        title=f"B={b} T={t} H={h} HV={hv} K=V={d} chunk={c}",
    )


if __name__ == "__main__":
    main()

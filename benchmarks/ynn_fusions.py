"""What XLA:CPU's YNNPACK fusions cost or gain the gated delta rule: forward+backward time
with them on (XLA's default) and off (`--xla_cpu_experimental_ynn_fusion_type=`).

`deltanet_cp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)`, float32,
chunk 64, B = 1, T = 2048, H = HV = 4, K = V = 64: the pullback of a fixed cotangent of `o`
to every input. Each setting runs in its own process, the two alternating (A/B/A/B...); a
round's time is the median of `--calls` calls after a warm-up, the ratio the median of the
rounds' paired ratios.

    python benchmarks/ynn_fusions.py             # about a minute on 2 quiet cores
    python benchmarks/ynn_fusions.py --rounds 2  # quicker
"""

import argparse
import os
import statistics
import subprocess
import sys


SETTINGS = {"on": "", "off": "--xla_cpu_experimental_ynn_fusion_type="}


def worker(calls: int, t: int, h: int, d: int) -> None:
    import time

    import jax
    import jax.numpy as jnp
    import jax.random as jr

    import deltanet_cp

    ks = jr.split(jr.key(0), 6)
    q, k = (jr.normal(x, (1, t, h, d)) for x in ks[:2])
    v = jr.normal(ks[2], (1, t, h, d))
    g = -jax.nn.softplus(jr.normal(ks[3], (1, t, h)))
    beta = jax.nn.sigmoid(jr.normal(ks[4], (1, t, h)))
    ct = jr.normal(ks[5], (1, t, h, d))

    def loss(*args):
        o, _ = deltanet_cp.chunk_gated_delta_rule(*args, use_qk_l2norm=True, chunk_size=64)
        return jnp.sum(o * ct)

    f = jax.jit(jax.grad(loss, argnums=range(5)))
    jax.block_until_ready(f(q, k, v, g, beta))  # compile and warm up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(f(q, k, v, g, beta))
        times.append(time.perf_counter() - start)
    print(statistics.median(times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="paired rounds")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per process")
    parser.add_argument("--t", type=int, default=2048, help="sequence length")
    parser.add_argument("--heads", type=int, default=4, help="H = HV")
    parser.add_argument("--dim", type=int, default=64, help="K = V")
    parser.add_argument("--worker", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.calls, args.t, args.heads, args.dim)
        return 0
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        for name, flag in SETTINGS.items():
            flags = " ".join(
                f
                for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_cpu_experimental_ynn_fusion_type")
            )
            env = {**os.environ, "XLA_FLAGS": f"{flags} {flag}".strip(), "JAX_PLATFORMS": "cpu"}
            cmd = [sys.executable, __file__, "--worker", name, "--calls", str(args.calls)]
            cmd += ["--t", str(args.t), "--heads", str(args.heads), "--dim", str(args.dim)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if out.returncode != 0:
                print(f"fusions {name}: exit {out.returncode}\n{out.stderr[-2000:]}")
                return 1
            times[name].append(float(out.stdout.split()[-1]))
            print(f"round {r + 1}, fusions {name}: {times[name][-1] * 1e3:.1f} ms", flush=True)
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    print(
        f"\nGated DeltaNet fwd+bwd, B=1 T={args.t} H=HV={args.heads} K=V={args.dim}, "
        f"chunk 64, float32; {args.rounds} paired rounds x {args.calls} calls"
    )
    print(f"{'YNN fusions':<12} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name in SETTINGS:
        ts = [x * 1e3 for x in times[name]]
        print(f"{name:<12} {statistics.median(ts):>10.1f} {min(ts):>8.1f} {max(ts):>8.1f}")
    print(f"on / off (median of paired ratios): {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

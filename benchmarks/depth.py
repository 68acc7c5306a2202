"""The structure of the compiled programs: sequential depth and temporaries per token.

Nothing is executed: every program is compiled (`jax.jit(f).lower(...).compile()`) and read.

- **Sequential depth** (`_seqdepth.py`): the ops inside `while` loops, each loop's body
  counted times its trips, per token (per local token under CP). On a GPU or TPU each such
  op is roughly one kernel launch on the critical path, repeated every chunk; on any
  backend it is the part of the program that cannot run in parallel over the sequence.
- **Ops outside loops**: what runs once a call. Compiled at two lengths (T and T / cp), it
  must not change: a count that grows with T would mean a loop unrolled over chunks.
- **Compiled temporaries**: `memory_analysis().temp_size_in_bytes` per token, one device
  and, under CP, per device per local token, beside one device at the same local length.
- **Matmul FLOPs** (`_seqdepth.matmul_flops`): every `dot` of the compiled HLO, inside
  fusions too, a loop body counted times its trips; one device.

Ours is compiled at the backend's default block size and at each `--blocks` size (tokens
whose factors are formed together): a block bounds the memory, and what the backward forms
again (the block's factors and chunk states) costs matmul FLOPs; a sequence in one block is
formed once (XLA merges the two).

Implementations (`_impls.py`): ours (`deltanet_cp.chunk_gated_delta_rule`; under CP with
`cp=ContextParallel("cp", exchange=..., mesh=mesh)`, each exchange), MaxText's JAX kernel
(under CP its `cp_axis=` path) and jax-linear-attention's plain-JAX chunked path (under CP
its `context_parallel_linear_attention`). Forward, and forward+backward (the pullback of `o`
and the final state to all five inputs). Qwen3-Next heads (B=1, H=16, HV=32, K=V=128),
float32, chunk 64, q/k L2 norm, T=4096; CP on 4 simulated CPU devices (a mesh with Auto
axes). On a GPU machine the same script compiles for the GPU (the CP rows need 4 devices
and are skipped on one).

    python benchmarks/depth.py            # about a minute
    python benchmarks/depth.py --quick    # tiny heads, T=512
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import machine_line, print_table  # noqa: E402
from _impls import jax_forward, jax_forward_cp, load_peer, pullback  # noqa: E402
from _seqdepth import depth, matmul_flops  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


FULL = dict(b=1, h=16, hv=32, d=128, t=4096, label="Qwen3-Next heads (H=16, HV=32, K=V=128)")
QUICK = dict(b=1, h=2, hv=4, d=32, t=512, label="tiny heads (H=2, HV=4, K=V=32)")
CHUNK = 64
CP = 4
IMPLS = {"ours": "ours", "MaxText": "maxtext", "jla": "jla"}
PASSES = ["fwd", "fwd+bwd"]


def abstract_args(b, t, h, hv, d, sharding=None, replicated=None):
    """Shapes of `(q, k, v, g, beta)` and of the cotangents `(do, dh)`."""

    def s(shape, sh):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)

    args = (
        s((b, t, h, d), sharding),
        s((b, t, h, d), sharding),
        s((b, t, hv, d), sharding),
        s((b, t, hv), sharding),
        s((b, t, hv), sharding),
    )
    cot = (s((b, t, hv, d), sharding), s((b, hv, d, d), replicated))
    return args, cot


def measure(forward, args, cot) -> dict:
    """`{pass: (Depth, temp bytes, compile seconds, matmul FLOPs)}` for the forward and its
    pullback."""
    out = {}
    for p, fn, a in [("fwd", forward, args), ("fwd+bwd", pullback(forward), (args, cot))]:
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*a).compile()
        seconds = time.perf_counter() - start
        memory = compiled.memory_analysis()
        temp = None if memory is None else memory.temp_size_in_bytes
        out[p] = (depth(compiled), temp, seconds, matmul_flops(compiled))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny heads, T=512")
    parser.add_argument("--t", type=int, default=None, help="sequence length")
    parser.add_argument("--only", default=None, help="comma-separated implementations")
    parser.add_argument("--no-cp", action="store_true", help="one device only")
    parser.add_argument("--wheels", default=None, help="a directory with the peers' wheels")
    parser.add_argument(
        "--blocks", default="4096", help="comma-separated extra block sizes for ours ('' none)"
    )
    args = parser.parse_args()

    shape = dict(QUICK if args.quick else FULL)
    label = shape.pop("label")
    t = args.t or shape.pop("t")
    shape.pop("t", None)
    b, h, hv, d = shape["b"], shape["h"], shape["hv"], shape["d"]
    dims = dict(h=h, hv=hv, d=d, chunk=CHUNK, wheels=args.wheels)
    names = args.only.split(",") if args.only else list(IMPLS)
    start = time.monotonic()
    device = jax.devices()[0]
    print(
        f"jax {jax.__version__} on {jax.default_backend()} "
        f"({getattr(device, 'device_kind', device)}); {label}, B={b}, float32, chunk {CHUNK}, "
        f"q/k L2 norm; compiled, not run"
    )
    print(f"machine: {machine_line()}", flush=True)

    versions, skipped = {}, {}
    for n in list(names):
        try:
            versions[n] = load_peer(IMPLS[n], args.wheels)[1]
        except Exception as e:
            skipped[n] = f"{type(e).__name__}: {e}"
            names.remove(n)
    print("implementations: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
    for n, why in skipped.items():
        print(f"{n} skipped: {why}")

    # (name, devices, exchange label, tokens per device) -> {pass: (Depth, temp, s)}
    results = {}
    local = t // CP
    for n in names:
        forward = jax_forward(IMPLS[n], **dims)
        for length in (t, local):
            results[(n, 1, "", length)] = measure(forward, *abstract_args(b, length, h, hv, d))
            print(f"  {n}, one device, T={length}: compiled", flush=True)
    blocks = [int(x) for x in args.blocks.split(",") if x] if "ours" in names else []
    for size in blocks:
        forward = jax_forward("ours", block_size=size, **dims)
        results[(f"ours, block {size}", 1, "", t)] = measure(
            forward, *abstract_args(b, t, h, hv, d)
        )
        print(f"  ours, block {size}: compiled", flush=True)
    cp_ok = not args.no_cp and len(jax.devices()) >= CP
    if cp_ok:
        auto = (jax.sharding.AxisType.Auto,)  # jla slices its sharded final states
        mesh = jax.make_mesh((CP,), ("cp",), auto, devices=jax.devices()[:CP])
        seq, rep = NamedSharding(mesh, P(None, "cp")), NamedSharding(mesh, P())
        cp_args = abstract_args(b, t, h, hv, d, sharding=seq, replicated=rep)
        configs = []
        if "ours" in names:
            import deltanet_cp as dcp

            for exchange in (dcp.AllGather(), dcp.PPermute(), dcp.Ring()):
                configs.append(("ours", type(exchange).__name__, exchange))
        if "MaxText" in names:
            configs.append(("MaxText", "its ppermute prefix", None))
        if "jla" in names:
            configs.append(("jla", "its all-gather", None))
        for n, exchange_label, exchange in configs:
            forward = jax_forward_cp(IMPLS[n], mesh, exchange=exchange, **dims)
            try:
                results[(n, CP, exchange_label, local)] = measure(forward, *cp_args)
            except Exception as e:
                skipped[f"{n} cp={CP} {exchange_label}"] = f"{type(e).__name__}: {e}"[:300]
                continue
            print(f"  {n}, cp={CP} ({exchange_label}): compiled", flush=True)
    elif not args.no_cp:
        print(f"CP rows skipped: {len(jax.devices())} device(s), {CP} needed")

    def where(n, devices, exchange):
        if devices == 1:
            return f"{n}, one device"
        return f"{n}, cp={devices}, {exchange}"

    depth_rows, outside_rows, temp_rows = [], [], []
    for (n, devices, exchange, tokens), r in results.items():
        if devices == 1 and tokens != t:
            continue
        row = [where(n, devices, exchange), tokens]  # depth
        for p in PASSES:
            dp = r[p][0]
            row += [f"{dp.inside / tokens:.2f}", dp.loops_text()]
        depth_rows.append(row)
    flop_rows = []
    reference = results.get(("MaxText", 1, "", t))
    for (n, devices, exchange, tokens), r in results.items():
        if devices != 1 or tokens != t:
            continue
        fwd, both = r["fwd"][3] / 1e9, r["fwd+bwd"][3] / 1e9
        row = [n, f"{fwd:.2f}", f"{both:.2f}", f"{both / fwd:.2f}"]
        if reference is not None:
            row += [f"{fwd / (reference['fwd'][3] / 1e9):.2f}x"]
            row += [f"{both / (reference['fwd+bwd'][3] / 1e9):.2f}x"]
        flop_rows.append(row)
    for n in names:
        long, short = results[(n, 1, "", t)], results[(n, 1, "", local)]
        outside_rows.append(
            [n]
            + [x for p in PASSES for x in (long[p][0].outside, short[p][0].outside)]
            + ["yes" if all(long[p][0].outside == short[p][0].outside for p in PASSES) else "no"]
        )
    for (n, devices, exchange, tokens), r in results.items():
        one = results.get((n, 1, "", tokens))
        row = [where(n, devices, exchange), tokens]
        for p in PASSES:
            temp = r[p][1]
            row.append("-" if temp is None else f"{temp / tokens / 1024:.1f}")
        for p in PASSES:
            if devices == 1 or one is None or r[p][1] is None or not one[p][1]:
                row.append("")
            else:
                row.append(f"{r[p][1] / one[p][1]:.2f}x")
        temp_rows.append(row)

    print_table(
        [
            "implementation",
            "tokens per device",
            "fwd ops in loops / token",
            "fwd loops (trips x ops)",
            "fwd+bwd ops in loops / token",
            "fwd+bwd loops (trips x ops)",
        ],
        depth_rows,
        title=f"Sequential depth at T={t}: ops inside while loops x trips, per token of a "
        "device (XLA's optimized HLO; a fusion is one op)",
    )
    print_table(
        ["implementation", "fwd GFLOP", "fwd+bwd GFLOP", "fwd+bwd / fwd"]
        + (["fwd vs MaxText", "fwd+bwd vs MaxText"] if reference is not None else []),
        flop_rows,
        title=f"Matmul FLOPs at T={t}, one device: every dot of the compiled HLO, loop bodies "
        "times their trips",
    )
    print_table(
        ["implementation"]
        + [f"{p} at T={x}" for p in PASSES for x in (t, local)]
        + ["independent of T"],
        outside_rows,
        title="Ops outside loops (run once a call), one device, at two lengths",
    )
    cp_note = f"; at cp={CP} per device per local token, and / one device at that length"
    print_table(
        [
            "implementation",
            "tokens per device",
            "fwd KiB/token",
            "fwd+bwd KiB/token",
            "fwd vs one device",
            "fwd+bwd vs one device",
        ],
        temp_rows,
        title="Compiled temporaries (memory_analysis().temp_size_in_bytes) per token"
        + (cp_note if cp_ok else ""),
    )
    for n, why in skipped.items():
        if " cp=" in n:
            print(f"{n}: {why}")
    print(f"\nwhole run {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

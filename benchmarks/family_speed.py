"""Gated DeltaNet-2 and the generalized delta rule (DPLR) against our Gated DeltaNet, and
GDN-2 against jax-linear-attention's plain-JAX `gdn2`: time and compiled temporaries.

float32, chunk 64, the final state returned, B = 1, K = V = 128, Qwen3-Next-like heads
(T = 2048, HV = 32 value heads; q and k with H = 16 heads where the recurrence allows it,
which is all of ours; jla gets them repeated to 32); forward, and forward+backward (the
pullback of fixed cotangents of `o` and the final state to every input). Implementations:

- `GDN`: `deltanet_cp.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)`;
- `KDA`: `deltanet_cp.chunk_kimi_delta_attention` (decays per key channel, for reference);
- `GDN-2`: `deltanet_cp.chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm=True)`;
- `DPLR`: `deltanet_cp.chunk_dplr_delta_rule(q, k, v, a, b, gk)`, RWKV-7-like inputs
  (`a = -kk`, `b = kk * sigmoid(.)`, `kk` unit vectors; `gk` per value head);
- `jla GDN-2`: jax-linear-attention 0.1.0's `jla.ops.chunked.gdn2` (`_jla.py`), the same
  inputs as ours.

Each runs in its own process through `_harness.py` (stopped while another is timed, the
order rotating, ratios the median of per-round ratios). Temporaries are
`memory_analysis().temp_size_in_bytes` of the compiled program, per token. Needs the
environment of `make bench` for jla (`--only GDN,GDN-2,DPLR` runs without it).

    python benchmarks/family_speed.py             # about 5 minutes on 2 quiet cores
    python benchmarks/family_speed.py --quick     # tiny shapes, a smoke test
"""

import argparse
import os
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import machine_line, print_table  # noqa: E402
from _harness import Impl, max_rel_diff, Prepared, Session  # noqa: E402


PASSES = ["fwd", "fwd+bwd"]
IMPLS = {
    "GDN": Impl("GDN", "family_speed:ours", {"kind": "gdn"}),
    "KDA": Impl("KDA", "family_speed:ours", {"kind": "kda"}),
    "GDN-2": Impl("GDN-2", "family_speed:ours", {"kind": "gdn2"}),
    "DPLR": Impl("DPLR", "family_speed:ours", {"kind": "dplr"}),
    "jla GDN-2": Impl("jla GDN-2", "family_speed:jla_gdn2"),
}
# (label, B, T, H, HV, K = V, paired rounds)
SHAPES = [("Qwen3-Next-like heads: H=16, HV=32, T=2048", 1, 2048, 16, 32, 128, 5)]
QUICK = [("tiny: H=2, HV=4, K=V=32, T=256", 1, 256, 2, 4, 32, 3)]
CHUNK = 64


def _inputs(kind: str, b: int, t: int, h: int, hv: int, d: int) -> list:
    """float32 numpy inputs in the public argument order of `kind`, seed 0."""
    import numpy as np

    rng = np.random.default_rng(0)

    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    def sigmoid(x):
        return (1 / (1 + np.exp(-x))).astype(np.float32)

    def log_decay(*shape):
        return (-np.log1p(np.exp(normal(*shape)))).astype(np.float32)

    q, k, v = normal(b, t, h, d), normal(b, t, h, d), normal(b, t, hv, d)
    if kind == "gdn":
        return [q, k, v, log_decay(b, t, hv), sigmoid(normal(b, t, hv))]
    if kind == "kda":
        return [q, k, v, log_decay(b, t, hv, d), sigmoid(normal(b, t, hv))]
    if kind in ("gdn2", "jla_gdn2"):
        g = log_decay(b, t, hv, d)
        return [q, k, v, g, sigmoid(normal(b, t, hv, d)), sigmoid(normal(b, t, hv, d))]
    kk = normal(b, t, h, d)
    kk = kk / np.linalg.norm(kk, axis=-1, keepdims=True)
    a, bb = -kk, kk * sigmoid(normal(b, t, h, d))
    return [q, k / np.sqrt(d), v, a, bb, log_decay(b, t, hv, d)]


def _forward(kind: str, h: int, hv: int):
    import jax.numpy as jnp

    if kind == "jla_gdn2":
        from _jla import load_jla

        jla = load_jla()

        def forward(q, k, v, g, b, w):
            q, k = jnp.repeat(q, hv // h, axis=2), jnp.repeat(k, hv // h, axis=2)
            return jla.chunked.gdn2(
                q, k, v, g, b, w, output_final_state=True, use_qk_l2norm=True, chunk_size=CHUNK
            )

        return forward, jla.version
    from _impls import import_ours

    dcp = import_ours()
    fn = {
        "gdn": dcp.chunk_gated_delta_rule,
        "kda": dcp.chunk_kimi_delta_attention,
        "gdn2": dcp.chunk_gdn2,
    }.get(kind)
    if fn is None:

        def forward(*args):
            return dcp.chunk_dplr_delta_rule(*args, chunk_size=CHUNK)

    else:

        def forward(*args):
            return fn(*args, use_qk_l2norm=True, chunk_size=CHUNK)

    return forward, dcp.__version__


def _prepared(kind: str, *, b: int, t: int, h: int, hv: int, d: int, passes=PASSES):
    import jax
    import jax.numpy as jnp
    import numpy as np

    forward, version = _forward(kind, h, hv)
    args = tuple(jnp.asarray(x) for x in _inputs(kind, b, t, h, hv, d))
    rng = np.random.default_rng(1)
    cots = (
        jnp.asarray(rng.standard_normal((b, t, hv, d), dtype=np.float32)),
        jnp.asarray(rng.standard_normal((b, hv, d, d), dtype=np.float32)),
    )

    def fwd_bwd(args, cots):
        return jax.vjp(forward, *args)[1](cots)

    info = {"version": version, "jax": jax.__version__}
    programs = {"fwd": (forward, args), "fwd+bwd": (fwd_bwd, (args, cots))}
    calls = {}
    for p in passes:
        fn, a = programs[p]
        start = time.perf_counter()
        c = jax.jit(fn).lower(*a).compile()
        info[f"compile_s {p}"] = time.perf_counter() - start
        m = c.memory_analysis()
        if m is not None:
            info[f"temp_bytes {p}"] = m.temp_size_in_bytes
        calls[p] = lambda c=c, a=a: jax.block_until_ready(c(*a))

    def outputs():
        o, h_t = jax.jit(forward)(*args)
        return {"o": np.asarray(o, np.float32), "h": np.asarray(h_t, np.float32)}

    return Prepared(calls, outputs, info)


def ours(*, kind: str, **case) -> Prepared:
    """One of our recurrences on one device (`kind`: gdn, kda, gdn2 or dplr)."""
    return _prepared(kind, **case)


def jla_gdn2(**case) -> Prepared:
    """jax-linear-attention's `jla.ops.chunked.gdn2` on one device."""
    return _prepared("jla_gdn2", **case)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, a smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="paired rounds per shape")
    parser.add_argument("--calls", type=int, default=1, help="calls per pass per round")
    parser.add_argument("--only", default=None, help="comma-separated implementations")
    parser.add_argument("--budget", type=float, default=1200, help="seconds for the whole run")
    parser.add_argument("--hang-after", type=float, default=30, help="seconds without CPU time")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(IMPLS)
    start = time.monotonic()
    print(f"machine before: {machine_line()}", flush=True)
    env = {}
    rows, mem_rows, notes = [], [], []
    with Session(
        [IMPLS[n] for n in names],
        hang_after=args.hang_after,
        deadline=start + args.budget,
        retries=1,
        env=env,
    ) as session:
        for label, b, t, h, hv, d, rounds in QUICK if args.quick else SHAPES:
            print(f"{label}:", flush=True)
            session.prepare(b=b, t=t, h=h, hv=hv, d=d)
            res = session.time(PASSES, rounds=args.rounds or rounds, calls=args.calls)
            loads = [x for n in names for x in res.outcomes[n].loads if x is not None]
            during = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
            print(f"  load average during the rounds {during}; {machine_line()}", flush=True)
            base = "GDN" if "GDN" in names else names[0]
            for n in names:
                info = res.outcomes[n].info
                row = [label, n]
                for p in PASSES:
                    r = res.ratio(n, base, p)
                    row += [res.ms(n, p), f"{r:.2f}x" if r is not None else "-"]
                rows.append(row + [during])
                kib = [
                    f"{info[f'temp_bytes {p}'] / t / 1024:.0f}"
                    if f"temp_bytes {p}" in info
                    else "-"
                    for p in PASSES
                ]
                mem_rows.append([label, n, *kib])
            if "GDN-2" in names and "jla GDN-2" in names:
                ratios = [res.ratio("jla GDN-2", "GDN-2", p) for p in PASSES]
                print(
                    "  jla GDN-2 / our GDN-2, median of per-round time ratios: "
                    + ", ".join(f"{p} {r:.2f}x" for p, r in zip(PASSES, ratios) if r is not None)
                )
            if "GDN-2" in res.outputs and "jla GDN-2" in res.outputs:
                ours_out, theirs = res.outputs["GDN-2"], res.outputs["jla GDN-2"]
                diffs = ", ".join(
                    f"{x} {max_rel_diff(theirs[x], ours_out[x]):.1e}" for x in ("o", "h")
                )
                print(f"  jla GDN-2 vs ours, largest relative difference: {diffs}")
            notes += res.notes()
    print_table(
        ["shape (B=1, float32)", "implementation", "fwd ms", "fwd / GDN", "fwd+bwd ms"]
        + ["fwd+bwd / GDN", "load during"],
        rows,
        title="Medians over paired rounds, one process per implementation; X / GDN = median "
        "of per-round time ratios (< 1: faster than our GDN)",
    )
    print_table(
        ["shape", "implementation", "temporaries fwd, KiB/token", "fwd+bwd, KiB/token"],
        mem_rows,
        title="Compiled temporaries (memory_analysis().temp_size_in_bytes / T)",
    )
    if notes:
        print("\n* " + "\n* ".join(notes))
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

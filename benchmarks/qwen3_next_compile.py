"""Qwen3-Next-80B-A3B's layers compiled, never run: what context parallelism adds to the
FLOPs, bytes accessed and temporaries of a training step, beside the AOT figures of
MaxText's Gated DeltaNet context-parallel change.

A slice of `Qwen3NextForCausalLM` at the released model's layer sizes: hidden 2048; one
gated full-attention layer (16 query heads of dim 256, 2 key/value heads, a quarter of
each head rotated) and three Gated DeltaNet layers (16 key heads, 32 value heads, K = V =
128, conv 4, chunk 64), in the model's order (three GDN, then attention); every layer with
its sparse MoE block (512 experts, top-10 renormalised, expert width 512, a gated shared
expert of width 512). The vocabulary is 1024, not 151,936, so that the embedding and the
LM head stay out of the comparison. Parameters float32 (`--dtype`); one sequence.

The model is built abstractly (`equinox.filter_eval_shape`), its inputs are
`jax.ShapeDtypeStruct`s, and each program is only lowered and compiled
(`jax.jit(...).lower(...).compile()`), on simulated CPU devices, so nothing is allocated:
cp = 1 (no `shard_map`) and cp = 4 (the model's `cp=ContextParallel("cp")` inside
`jax.shard_map`, contiguous shards, the recurrences' states exchanged by all-gather,
attention's keys and values all-gathered), at the same global length (8192 tokens, 2048
per rank) and at the same local length (cp = 4 at 32768 tokens, 8192 per rank). Two
programs each: the forward (the loss) and the forward+backward (the loss and its gradient
with respect to every parameter). The loss is the mean next-token negative log-likelihood
plus `router_aux_loss_coef` times the load-balancing loss, summed over the ranks (`psum`).

Read from each compiled program (per device: a compiled SPMD module is one device's):

- matmul FLOPs: every `dot`, a loop body times its trips (`_seqdepth`'s count). Under CP
  the attention kernel's loops over tiles run a rank-dependent number of tiles, which the
  per-rank module does not hold (its trip count is unknown to XLA): those loops' bodies
  are counted times the causal tiles (`tile`-square blocks holding a visible pair) of the
  busiest rank (per device) or of all ranks (all devices); on one device every loop's
  trips are known;
- bytes accessed: `cost_analysis()["bytes accessed"]` (XLA counts a loop body once);
- temporaries: `memory_analysis().temp_size_in_bytes`;
- the bytes the busiest rank receives, from the compiled HLO's collectives, a collective in
  a loop body times its trips; per layer, a model of two layers of one kind minus a model
  of one (so the loss's own `psum`s cancel), the exchanges (all-gathers, permutes,
  reduce-scatters, all-to-alls) apart from the all-reduce of the replicated parameters'
  gradients.

The MoE's routed experts (`deltanet_cp.nn.SparseMoE`) run a loop over tiles of one
expert's pairs whose trip count depends on the routing, so the compiled program does not
hold it: their loops are recognised by their bodies (those of one MoE layer compiled alone
on a rank's tokens), taken out, and the routed experts counted at the routed (active)
count `2 * 3 T k H I` per layer forward, three times that forward and backward (the
benchmarks page measures the loop at 1.13 times that count at E = 64, top-4).

The note's figures (MaxText, the whole 80B model on a TPU v5p-64 at 8192 tokens; FLOPs
and HBM bytes at the same global length, peak temporaries per device): +0.20% FLOPs,
+3.6% HBM bytes, +8.7% peak temporaries at cp = 4.

    python benchmarks/qwen3_next_compile.py            # the released sizes (minutes)
    python benchmarks/qwen3_next_compile.py --quick    # small layers, a smoke test
    python benchmarks/qwen3_next_compile.py --experts 64   # fewer experts (top-k kept)
"""

import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()


import argparse  # noqa: E402
import dataclasses  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
from _common import machine_line, print_table  # noqa: E402
from _impls import import_ours  # noqa: E402
from _seqdepth import _computations, _DEF, _dot, _OPCODE, _shape, _trips  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


dcp = import_ours()
from deltanet_cp.models import Qwen3NextConfig, Qwen3NextForCausalLM  # noqa: E402
from deltanet_cp.nn import expert_partition_specs, load_balancing_loss  # noqa: E402
from deltanet_cp.nn._moe import _tile_rows  # noqa: E402


CP = 4
TILE = 128  # Qwen3NextForCausalLM's default attention tile
# The released Qwen3-Next-80B-A3B's layer sizes (its config.json), a small vocabulary.
FULL = dict(
    vocab_size=1024,
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=5120,
    num_experts=512,
    num_experts_per_tok=10,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    norm_topk_prob=True,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    full_attention_interval=4,
)
QUICK = dict(
    FULL,
    hidden_size=256,
    num_attention_heads=4,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    intermediate_size=512,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)
NOTE = {
    "FLOPs": (21_874_845_155_328, 21_919_038_439_424),
    "HBM bytes": (559_759_491_072, 579_720_052_736),
    "peak temp": (64_807_110_912, 70_465_474_464),
}


@dataclasses.dataclass(frozen=True)
class Run:
    """One compiled configuration: `cp` ranks, `tokens` in the whole sequence."""

    cp: int
    tokens: int
    experts_over_cp: bool = False  # the routed experts split over the cp ranks

    @property
    def local(self) -> int:
        return self.tokens // self.cp

    def label(self) -> str:
        split = ", experts over cp" if self.experts_over_cp else ""
        return f"cp={self.cp}, T={self.tokens} ({self.local}/rank){split}"


def is_struct(x) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct)


def config(sizes: dict, layers: int, layer_types=None) -> Qwen3NextConfig:
    types = {} if layer_types is None else {"layer_types": tuple(layer_types)}
    return Qwen3NextConfig(num_hidden_layers=layers, **sizes, **types)


def programs(cfg: Qwen3NextConfig, run: Run, dtype):
    """`{"fwd": compiled, "fwd+bwd": compiled}` for `cfg`'s model at `run`, and their seconds."""
    model = eqx.filter_eval_shape(Qwen3NextForCausalLM, cfg, key=jr.key(0), dtype=dtype)
    params, static = eqx.partition(model, is_struct)
    coef = cfg.router_aux_loss_coef

    axis = "cp" if run.experts_over_cp else None

    def rank_loss(params, tokens, targets, cp):
        m = eqx.combine(params, static)
        logits, stats = m.logits_and_router_stats(tokens, cp=cp, expert_axis=axis)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, targets[:, None], axis=-1))
        return nll, stats

    if run.cp == 1:

        def loss(params, tokens, targets):
            nll, stats = rank_loss(params, tokens, targets, None)
            return nll / run.tokens + coef * load_balancing_loss(stats)

        seq = None
    else:
        mesh = jax.make_mesh((run.cp,), ("cp",), devices=jax.devices()[: run.cp])
        context = dcp.ContextParallel("cp")

        def per_rank(params, tokens, targets):
            nll, stats = rank_loss(params, tokens, targets, context)
            nll, stats = jax.lax.psum((nll, stats), "cp")
            return nll / run.tokens + coef * load_balancing_loss(stats)

        specs = (
            expert_partition_specs(params, "cp") if axis else jax.tree.map(lambda _: P(), params)
        )
        loss = jax.shard_map(per_rank, mesh=mesh, in_specs=(specs, P("cp"), P("cp")), out_specs=P())
        seq = NamedSharding(mesh, P("cp"))
        params = jax.tree.map(
            lambda s, p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, p)),
            params,
            specs,
        )
    tokens = jax.ShapeDtypeStruct((run.tokens,), jnp.int32, sharding=seq)
    compiled, seconds = {}, {}
    for name, fn in (("fwd", loss), ("fwd+bwd", jax.value_and_grad(loss))):
        start = time.perf_counter()
        compiled[name] = jax.jit(fn).lower(params, tokens, tokens).compile()
        seconds[name] = time.perf_counter() - start
    return compiled, seconds


def split_flops(compiled) -> tuple[float, list[float]]:
    """Matmul FLOPs of a compiled module (every `dot`, `_seqdepth.hlo_matmul_flops`'s count)
    in two parts: the dots in loops whose trips XLA knows (times the trips) and outside
    loops; and, per loop whose trips XLA does not know, one trip's.

    The attention kernel's loops over tiles run a rank-dependent number of tiles under
    context parallelism, which the compiled per-rank module does not hold; on one device
    they have a known trip count.
    """
    text = compiled.as_text() or ""
    computations, entry = _computations(text)
    trips = dcp.internal.loop_trips(text)
    unknown: list[float] = []
    memo: dict[str, float] = {}

    def count(name: str) -> float:
        if name in memo:
            return memo[name]
        shapes = {}
        for line in computations.get(name, []):
            m = _DEF.match(line)
            if m:
                shapes[m.group(1)] = _shape(m.group(2))
        total = 0.0
        for line in computations.get(name, []):
            m = _OPCODE.match(line)
            op = m.group(1) if m else None
            if op == "dot":
                total += _dot(line, shapes)
            elif op == "while":
                body = count(re.search(r"body=%?([\w.\-]+)", line).group(1))
                if '"known_trip_count"' in line:
                    total += _trips(line, trips) * body
                elif body:
                    unknown.append(body)
            else:
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                    total += count(callee)
        memo[name] = total
        return total

    return count(entry), unknown


def causal_tiles(tokens: int, cp: int, tile: int) -> tuple[int, int]:
    """The tiles of a causal `(tokens, tokens)` score matrix in `tile`-square blocks that hold a
    visible pair: in all (each rank its contiguous rows) and on the busiest (last) rank."""
    n = tokens // tile
    rows = range(n - n // cp, n)
    return n * (n + 1) // 2, sum(r + 1 for r in rows)


EXCHANGES = ("collective-permute", "all-gather", "reduce-scatter", "all-to-all")


def received(compiled, kinds: tuple[str, ...] = (*EXCHANGES, "all-reduce")) -> int:
    """Bytes the busiest rank receives: the collectives of `kinds` in the compiled HLO, one
    in a loop body counted once per trip (nested loops multiplied)."""
    text = compiled.as_text() or ""
    computations, entry = _computations(text)
    trips = dcp.internal.loop_trips(text)
    memo: dict[str, dict[int, int]] = {}

    def per_rank(name: str) -> dict[int, int]:
        if name in memo:
            return memo[name]
        memo[name] = {}
        total: dict[int, int] = {}

        def add(d: dict[int, int], times: int = 1):
            for r, b in d.items():
                total[r] = total.get(r, 0) + times * b

        lines = computations.get(name, [])
        add(dcp.internal.received_bytes_per_rank("\n".join(lines), kinds))
        for line in lines:
            if re.search(r"\bwhile\(", line):
                body = re.search(r"body=%?([\w.\-]+)", line)
                if body:
                    add(per_rank(body.group(1)), _trips(line, trips))
            else:
                for callee in re.findall(r"(?:calls|to_apply)=%?([\w.\-]+)", line):
                    add(per_rank(callee))
                branches = re.search(r"branch_computations=\{([^}]*)\}", line)
                if branches:
                    options = [per_rank(b) for b in re.findall(r"%?([\w.\-]+)", branches.group(1))]
                    add(max(options, key=lambda d: max(d.values(), default=0), default={}))
        memo[name] = total
        return total

    return max(per_rank(entry).values(), default=0)


def without(unknown: list[float], bodies: list[float]) -> list[float]:
    """`unknown` less one loop of each body FLOPs in `bodies` (the MoE layers' loops)."""
    rest = list(unknown)
    for body in bodies:
        match = min(range(len(rest)), key=lambda j: abs(rest[j] - body), default=None)
        if match is None or abs(rest[match] - body) > 1e-9 * max(body, 1.0):
            raise RuntimeError(f"no loop of {body:.0f} FLOPs among {rest}: the MoE changed")
        rest.pop(match)
    return rest


def measure(compiled, run: Run, tile: int, moe_bodies: list[float]) -> dict:
    """Per device: matmul FLOPs of the busiest rank (`flops`) and summed over the ranks
    (`total`) without the MoE layers' routed experts (`moe_bodies`: their loops' bodies,
    whose trips depend on the routing), the other unknown-trip loops (attention's tiles
    under CP) given their tiles; bytes accessed, temporaries, bytes received by the
    busiest rank."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    memory = compiled.memory_analysis()
    known, unknown = split_flops(compiled)
    unknown = without(unknown, moe_bodies)
    # On one device every loop's trips are known (the attention's static tile schedule); a
    # loop of unknown trips there is someone else's and is counted once (and flagged).
    total_tiles, busiest_tiles = causal_tiles(run.tokens, run.cp, tile) if run.cp > 1 else (1, 1)
    return {
        "flops": known + busiest_tiles * sum(unknown),
        "total": run.cp * known + total_tiles * sum(unknown),
        "unknown_loops": len(unknown),
        "bytes": float(cost.get("bytes accessed", float("nan"))),
        "temp": memory.temp_size_in_bytes if memory is not None else float("nan"),
        "received": received(compiled),
    }


def moe_bodies(sizes: dict, run: Run) -> dict[str, list[float]]:
    """Per pass, the matmul FLOPs of one trip of each loop of one MoE layer's routed experts
    in `run`'s programs: a tile of `tile` pairs through one expert, three products forward
    (gate, up, down), six backward (the forward's two projections kept)."""
    h, e, k = sizes["hidden_size"], sizes["num_experts"], sizes["num_experts_per_tok"]
    held = e // run.cp if run.experts_over_cp else e
    tile = _tile_rows(run.local * k, held)
    product = 2.0 * tile * h * sizes["moe_intermediate_size"]
    return {"fwd": [3 * product], "fwd+bwd": [3 * product, 6 * product]}


def routed_count(sizes: dict, tokens: int) -> float:
    """The routed experts' matmul FLOPs of one MoE layer forward: `2 * 3 T k H I`."""
    h, k, i = sizes["hidden_size"], sizes["num_experts_per_tok"], sizes["moe_intermediate_size"]
    return 6.0 * tokens * k * h * i


def pct(a: float, b: float) -> str:
    return f"{(b - a) / a:+.2%}"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small layers, short sequences")
    parser.add_argument("--experts", type=int, default=None, help="routed experts (fewer)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype")
    parser.add_argument("--no-payload", action="store_true", help="skip the per-layer payload")
    args = parser.parse_args()
    sizes = dict(QUICK if args.quick else FULL)
    if args.experts:
        sizes["num_experts"] = args.experts
        sizes["num_experts_per_tok"] = min(sizes["num_experts_per_tok"], args.experts)
    dtype = jnp.dtype(args.dtype)
    base = 1024 if args.quick else 8192
    runs = [Run(1, base), Run(CP, base), Run(CP, CP * base)]
    runs += [Run(CP, base, True), Run(CP, CP * base, True)]
    start = time.monotonic()
    print(
        f"jax {jax.__version__}, deltanet_cp {dcp.__version__}; {len(jax.devices())} simulated "
        f"CPU devices; parameters {dtype.name}"
    )
    print(
        "sizes: "
        + ", ".join(f"{k}={v}" for k, v in sizes.items() if k not in ("norm_topk_prob",))
        + "; layers: 3 Gated DeltaNet + 1 full attention, each with its MoE block"
    )
    print(f"machine: {machine_line()}", flush=True)

    print(
        "The MoE's routed experts run loops whose trips depend on the routing: the FLOPs "
        "below count them at the routed count, 2 * 3 * T * top_k * H * I forward per layer "
        "(three times that forward and backward)"
    )

    cfg = config(sizes, 4)
    results = {}
    n_moe = 4
    for run in runs:
        compiled, seconds = programs(cfg, run, dtype)
        bodies = moe_bodies(sizes, run)
        for name, c in compiled.items():
            r = measure(c, run, min(TILE, run.local), n_moe * bodies[name])
            passes = 1 if name == "fwd" else 3
            routed = n_moe * passes * routed_count(sizes, run.tokens)  # all devices
            r["flops"] += routed / run.cp
            r["total"] += routed
            results[run, name] = dict(r, seconds=seconds[name])
        del compiled
        print(
            f"  {run.label()}: compiled in "
            + ", ".join(f"{n} {s:.0f} s" for n, s in seconds.items()),
            flush=True,
        )

    rows = []
    for run in runs:
        for name in ("fwd", "fwd+bwd"):
            r = results[run, name]
            rows.append(
                [run.label(), name, f"{r['flops'] / 1e12:.3f}", f"{r['total'] / 1e12:.3f}"]
                + [f"{r['bytes'] / 1e9:.1f}", f"{r['bytes'] * run.cp / 1e9:.1f}"]
                + [
                    f"{r['temp'] / 2**30:.2f}",
                    f"{r['received'] / 2**20:.2f}",
                    f"{r['seconds']:.0f}",
                ]
            )
    print_table(
        ["run", "pass", "matmul TFLOP/device", "all devices", "GB accessed/device"]
        + ["all devices", "temp GiB/device", "MiB received/rank", "compile s"],
        rows,
        title="Per compiled program (4 layers, one sequence)",
    )

    grad = "fwd+bwd"
    a, b, c, b_ep, c_ep = (results[r, grad] for r in runs)

    comparison = [
        ["FLOPs (matmul, all devices)", f"{NOTE['FLOPs'][0]:,}", f"{NOTE['FLOPs'][1]:,}"]
        + [pct(*NOTE["FLOPs"]), f"{a['total']:,.0f}", f"{b['total']:,.0f}"]
        + [pct(a["total"], b["total"])],
        ["HBM bytes (bytes accessed, all devices)", f"{NOTE['HBM bytes'][0]:,}"]
        + [f"{NOTE['HBM bytes'][1]:,}", pct(*NOTE["HBM bytes"])]
        + [f"{a['bytes']:,.0f}", f"{b['bytes'] * CP:,.0f}", pct(a["bytes"], b["bytes"] * CP)],
        ["peak temp (per device, same local length)", f"{NOTE['peak temp'][0]:,}"]
        + [f"{NOTE['peak temp'][1]:,}", pct(*NOTE["peak temp"])]
        + [f"{a['temp']:,}", f"{c['temp']:,}", pct(a["temp"], c["temp"])],
        ["  peak temp (per device, same global length)", "", "", ""]
        + [f"{a['temp']:,}", f"{b['temp']:,}", pct(a["temp"], b["temp"])],
        ["experts over cp: FLOPs (matmul, all devices)", "", "", ""]
        + [f"{a['total']:,.0f}", f"{b_ep['total']:,.0f}", pct(a["total"], b_ep["total"])],
        ["experts over cp: HBM bytes (all devices)", "", "", ""]
        + [f"{a['bytes']:,.0f}", f"{b_ep['bytes'] * CP:,.0f}", pct(a["bytes"], b_ep["bytes"] * CP)],
        ["experts over cp: peak temp (same local length)", "", "", ""]
        + [f"{a['temp']:,}", f"{c_ep['temp']:,}", pct(a["temp"], c_ep["temp"])],
        ["experts over cp: peak temp (same global length)", "", "", ""]
        + [f"{a['temp']:,}", f"{b_ep['temp']:,}", pct(a["temp"], b_ep["temp"])],
    ]
    print_table(
        ["forward+backward", "note: baseline", "note: cp=4", "note: delta"]
        + ["ours: cp=1", "ours: cp=4", "ours: delta"],
        comparison,
        title=f"Beside the note (its whole 80B model on a v5p-64; ours: the 4-layer slice). "
        f"FLOPs and bytes: cp=1 vs cp=4 at T={base}; temporaries: T={base} vs cp=4 at "
        f"T={CP * base} ({base} per rank) unless marked",
    )
    print(
        f"\nrouted experts of one MoE layer at T={base}, fwd+bwd, at the routed count: "
        f"{3 * routed_count(sizes, base) / 1e12:.3f} TFLOP"
    )

    if not args.no_payload:
        payload_table(sizes, dtype, runs[1:3])
    print(f"\nmachine after: {machine_line()}; whole run {time.monotonic() - start:.0f} s")
    return 0


def payload_table(sizes: dict, dtype, runs: list[Run]) -> None:
    """Bytes received per rank per layer: a model of two layers of one kind minus one."""
    rows = []
    for kind in ("linear_attention", "full_attention"):
        for run in runs:
            got = {}
            for layers in (1, 2):
                compiled, _ = programs(config(sizes, layers, [kind] * layers), run, dtype)
                got[layers] = {
                    (n, part): received(c, kinds)
                    for n, c in compiled.items()
                    for part, kinds in (("exchange", EXCHANGES), ("all-reduce", ("all-reduce",)))
                }
                del compiled
            per_layer = {key: (got[2][key] - got[1][key]) / 2**20 for key in got[1]}
            rows.append(
                ["Gated DeltaNet" if kind == "linear_attention" else "full attention"]
                + [run.label()]
                + [f"{per_layer['fwd', 'exchange']:.3f}", f"{per_layer['fwd+bwd', 'exchange']:.3f}"]
                + [f"{per_layer['fwd', 'all-reduce']:.3f}"]
                + [f"{per_layer['fwd+bwd', 'all-reduce']:,.1f}"]
            )
            print(f"  payload: {rows[-1][0]}, {run.label()}", flush=True)
    print_table(
        ["layer (with its MoE block)", "run", "exchanges fwd MiB/rank", "exchanges fwd+bwd"]
        + ["all-reduce fwd", "all-reduce fwd+bwd"],
        rows,
        title="Cross-rank payload per layer, received by the busiest rank (compiled HLO; two "
        "layers minus one). Exchanges: all-gathers, permutes, reduce-scatters, all-to-alls "
        "(the recurrence's maps, attention's keys and values, their gradients); all-reduce: "
        "the layer's replicated parameters' gradients summed over the ranks (2 (cp - 1) / cp "
        "of their bytes), what data parallelism pays too; the MoE exchanges nothing under CP",
    )


if __name__ == "__main__":
    sys.exit(main())

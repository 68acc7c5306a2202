"""The whole Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B training steps compiled for a 64-device
mesh, never run: bytes per device, matmul FLOPs per token and compile time.

The models at their released sizes (transformers' `Qwen3NextConfig` and
`Qwen3_5MoeTextConfig`, the released `config.json`s): hidden 2048; per four layers three
Gated DeltaNet layers (16 key and 32 value heads of dim 128, conv 4, chunk 64) and one gated
attention layer (16 query heads of dim 256, 2 key/value heads, a quarter of each head
rotated); every layer with its sparse MoE block (experts of width 512 and a gated shared
expert of width 512). Qwen3-Next-80B-A3B: 48 layers, 512 experts, top 10, vocabulary
151,936. Qwen3.5-35B-A3B: 40 layers, 256 experts, top 8, vocabulary 248,320. Both with an
untied LM head.

Built abstractly (`equinox.filter_eval_shape` of the constructor) with `scan_layers=True`
(the layers stacked by their period and run under `jax.lax.scan`), called with
`remat="layer"` (each layer keeps its input only; the backward recomputes it). The step:
the mean next-token loss (log-softmax in float32) plus `router_aux_loss_coef` times the
load-balancing loss over the whole batch, its gradient, one `optax.adamw` update; the
parameters and optimizer state donated. One sequence per data rank, each sequence split
over the context ranks (`ContextParallel("cp")`, contiguous shards, the recurrences' maps
and attention's keys and values all-gathered), the whole step inside one `jax.shard_map`.

The mesh: `--dp` x `--cp` simulated CPU devices (16 x 4 = 64), axes `("dp", "cp")`. The
layouts (`--layout`):

- `ep64`: the routed experts over both axes (`expert_partition_specs(params, ("dp",
  "cp"))`, 64 ranks), every other parameter and its moments replicated;
- `fsdp16+ep64`: the experts over both axes, every other parameter split over `"dp"`
  (`partition_specs(..., data_axis="dp", expert_axis=("dp", "cp"))`, the model called with
  `fsdp=FSDP("dp", specs)`: each layer gathered when it runs and again in its backward);
- `fsdp16+ep4`: the experts over `"cp"` (each rank gathers its context group's tokens
  only) and, like every other parameter, split over `"dp"` too;
- `fsdp64+ep64`: every parameter split over both axes (as MaxText's default FSDP over
  every chip), the experts over both;
- `fsdpcp+epdp`: `fsdp16+ep4` with the axes' roles swapped, for many context ranks: the
  experts over `"dp"` (each rank gathers the tokens of its data group, `dp` x its own,
  not the whole sequence) and every parameter split over `"cp"`.

The loss (`--loss-chunk`): 0 (default) takes the log-softmax of the full `(tokens,
vocab)` logits; `--loss-chunk N` computes the LM head and the loss N tokens at a time
(`deltanet_cp.data.chunked_causal_lm_loss` on the model's `hidden_states` and
`head_weight`, each chunk's logits recomputed in the backward), the way to train long
sequences: the full logits, their log-softmax and its gradient cost about 2.3 MiB per
token a device holds (151,936 words). With it the 80B step fits 95 GiB at 128K on 16 x 4
(74.0 GiB; 110.5 with the full logits), 256K on 8 x 8 (93.3), 512K on 4 x 16 (77.0,
`fsdpcp+epdp`; 137.7 with the experts over `"cp"`) and 1M on 2 x 32 (78.1,
`fsdpcp+epdp`); 2M on 1 x 64 needs 98.9 GiB, and fits 4 x 64 of 256 devices (73.3).

Precision (`--precision`): `mixed` (default: float32 parameters and Adam moments, the
master weights; each rank's slices cast to bfloat16 inside the step, so the model computes
and FSDP gathers in bfloat16 and the gradients come back float32), `bf16` (bfloat16
parameters and moments) or `f32` (float32 throughout).

Read from each compiled program (one device's: a compiled SPMD module is per device):

- bytes per device: the parameters and the optimizer state from their specs; from
  `memory_analysis()` the arguments (parameters, optimizer state, tokens), outputs,
  temporaries, and the peak the program can need, arguments + outputs - aliased +
  temporaries (the donated parameters and state alias the new ones);
- matmul FLOPs per token: every `dot`, a loop body times its trips (`_seqdepth`'s count),
  over the device's tokens. Two kinds of loops run a number of trips the compiled module
  does not hold: the routed experts' tiles (counted at the routed pairs, a device's tokens
  times top-k, as balanced routing gives every rank; the loop runs up to one tile per
  expert more) and attention's tiles under context parallelism (counted at the causal
  tiles, 128-token squares holding a visible pair, averaged over the context ranks).
  Beside it: 6 x the active parameters (every matmul weight but the embedding, the routed
  experts at top-k / experts) + attention's `6 x 2 x layers x heads x dim x T / 2` (scores
  and values, causal), per token. `remat="layer"` runs the forward twice, so the program's
  count is about 8/6 of that;
- bytes accessed: `cost_analysis()["bytes accessed"]`, XLA's count (a loop body once), as
  the note quotes its HBM bytes;
- compile time: tracing and lowering, then XLA's compile, on this machine's cores.

XLA:CPU would merge FSDP's backward all-gathers into the forward's (it drops the
optimization barriers that keep them apart, which GPU and TPU keep), so this script
compiles with that pass off (`--xla_disable_hlo_passes=cse_barrier_expander`), as
`fsdp_memory.py` does.

    python benchmarks/whole_model.py --model 80b --seq 4096 --layout ep64
    python benchmarks/whole_model.py --model 80b,35b --seq 4096,32768,131072 \\
        --layout ep64,fsdp16+ep64,fsdp16+ep4
    python benchmarks/whole_model.py --model 80b --seq 131072 --layout fsdp16+ep4 \\
        --loss-chunk 1024
    python benchmarks/whole_model.py --model 80b --seq 1048576 --layout fsdpcp+epdp \\
        --dp 2 --cp 32 --loss-chunk 1024
    WHOLE_MODEL_DEVICES=256 python benchmarks/whole_model.py --model 80b --seq 2097152 \\
        --layout fsdpcp+epdp --dp 4 --cp 64 --loss-chunk 1024
    python benchmarks/whole_model.py --quick        # tiny model, a smoke test
"""

import argparse
import dataclasses
import math
import os
import sys
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import simulate_cpu_devices  # noqa: E402


DEVICES = int(os.environ.get("WHOLE_MODEL_DEVICES", "64"))
simulate_cpu_devices(DEVICES)  # before jax is imported

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    Compiled,
    fsdp_specs,
    GiB,
    is_struct,
    machine_line,
    make_mesh,
    optimizer_specs,
    placed,
    print_table,
    shard_bytes,
)
from _impls import import_ours  # noqa: E402
from _seqdepth import hlo_loop_flops  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


dcp = import_ours()
from deltanet_cp import nn  # noqa: E402
from deltanet_cp.data import chunked_causal_lm_loss  # noqa: E402
from deltanet_cp.models import (  # noqa: E402
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)


FIT = 95 * GiB  # a TPU v5p chip's HBM
ATTENTION_TILE = 128  # the models' default attention tile
SHARED = dict(
    hidden_size=2048,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    rope_theta=10_000_000.0,
    partial_rotary_factor=0.25,
    full_attention_interval=4,
    tie_word_embeddings=False,
)
# name: (model class, config class, the released sizes)
MODELS: dict[str, tuple[Any, Any, dict]] = {
    "80b": (
        Qwen3NextForCausalLM,
        Qwen3NextConfig,
        dict(
            SHARED,
            vocab_size=151_936,
            num_hidden_layers=48,
            intermediate_size=5120,
            num_experts=512,
            num_experts_per_tok=10,
            norm_topk_prob=True,
        ),
    ),
    "35b": (
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeConfig,
        dict(
            SHARED,
            vocab_size=248_320,
            num_hidden_layers=40,
            num_experts=256,
            num_experts_per_tok=8,
        ),
    ),
}
TITLES = {"80b": "Qwen3-Next-80B-A3B", "35b": "Qwen3.5-35B-A3B"}
QUICK = dict(
    hidden_size=64,
    vocab_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=128,
    num_experts=64,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)
LAYOUTS = ("ep64", "fsdp16+ep64", "fsdp16+ep4", "fsdp64+ep64", "fsdpcp+epdp")
PRECISIONS = ("mixed", "bf16", "f32")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The FSDP axis (`None`: parameters whole but the experts) and the experts' axis."""

    data_axis: str | tuple[str, ...] | None
    expert_axis: str | tuple[str, ...]


def layout(name: str) -> Layout:
    return {
        "ep64": Layout(None, ("dp", "cp")),
        "fsdp16+ep64": Layout("dp", ("dp", "cp")),
        "fsdp16+ep4": Layout("dp", "cp"),
        "fsdp64+ep64": Layout(("dp", "cp"), ("dp", "cp")),
        "fsdpcp+epdp": Layout("cp", "dp"),
    }[name]


def config(model: str, quick: bool, layers: int | None):
    cls, config_cls, sizes = MODELS[model]
    sizes = dict(sizes, **QUICK) if quick else dict(sizes)
    if model == "35b":
        sizes.pop("intermediate_size", None)
    if layers is not None:
        sizes["num_hidden_layers"] = layers
    return cls, config_cls(**sizes)


def parameter_counts(params, cfg) -> dict[str, float]:
    """Total parameters, the routed experts' and the embedding's; the active ones (every
    matmul weight but the embedding's, the routed experts at top-k / experts)."""
    total = experts = 0
    is_experts = lambda x: isinstance(x, nn.SwiGLUExperts)  # noqa: E731
    for sub in jax.tree.leaves(params, is_leaf=is_experts):
        n = sum(math.prod(x.shape) for x in jax.tree.leaves(sub))
        total += n
        experts += n if is_experts(sub) else 0
    embedding = cfg.vocab_size * cfg.hidden_size
    active = total - embedding - experts + experts * cfg.num_experts_per_tok / cfg.num_experts
    return dict(total=total, experts=experts, embedding=embedding, active=active)


def model_flops_per_token(cfg, active: float, tokens: int) -> float:
    """6 x the active parameters + causal attention's scores and values (forward 2 x 2 x
    heads x dim x T / 2 per attention layer, three times that with the backward)."""
    attention_layers = sum(t == "full_attention" for t in cfg.layer_types)
    attention = 6 * attention_layers * cfg.num_attention_heads * cfg.head_dim * tokens
    return 6 * active + attention


def tile_rows(active_pairs: int, num_experts: int) -> int:
    """The routed experts' tile (`deltanet_cp.nn.SwiGLUExperts`' rule): the largest power
    of two up to 128 with `4 x experts x tile` at most the active pairs; at least 8."""
    tile = 128
    while tile > 8 and 4 * num_experts * tile > active_pairs:
        tile //= 2
    return tile


def step_flops(hlo: str, cfg, lay: Layout, mesh, tokens: int) -> tuple[float, int, int]:
    """Matmul FLOPs of one device's step (see the module docstring): the known loops times
    their trips, the routed experts' loops at the device's routed pairs, attention's at the
    mean causal tiles per context rank; and how many loops of each of those two kinds."""
    counted = hlo_loop_flops(hlo)
    cp = mesh.shape["cp"]
    expert_ranks = math.prod(mesh.shape[a] for a in _names(lay.expert_axis))
    local = tokens // cp
    held = cfg.num_experts // expert_ranks
    k = cfg.num_experts_per_tok
    tile = tile_rows(local * k, held)  # the rank's own pairs, before the gather
    product = 2.0 * tile * cfg.hidden_size * cfg.moe_intermediate_size
    n = tokens // ATTENTION_TILE
    attention_trips = n * (n + 1) / 2 / cp
    total, moe, attention = counted.known, 0, 0
    for body, times in counted.unknown:
        # Forward 3 products a tile (gate, up, down), recomputed 2 (the backward needs the
        # gate's and up's only), backward 6.
        if any(abs(body - c * product) <= 1e-6 * body for c in (2, 3, 6)):
            total += times * body * local * k / tile  # a device's routed pairs, by tiles
            moe += times
        else:
            total += times * body * attention_trips
            attention += times
    return total, moe, attention


def _names(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def build(
    model: str, cfg, cls, lay: Layout, precision: str, mesh, tokens: int, loss_chunk: int = 0
):
    """`(step, arguments, params, specs, state, state_specs)`: the jitted training step,
    its abstract placed arguments, and what each device holds. `loss_chunk`: the chunked
    loss's tokens per chunk (`deltanet_cp.data.chunked_causal_lm_loss`), 0 for the full
    logits."""
    dtype = jnp.bfloat16 if precision == "bf16" else jnp.float32
    abstract = eqx.filter_eval_shape(
        lambda: cls(cfg, chunk_size=64, scan_layers=True, key=jr.key(0), dtype=dtype)
    )
    params, static = eqx.partition(abstract, is_struct)
    if lay.data_axis is None:
        specs, fsdp = nn.expert_partition_specs(params, lay.expert_axis), None
    else:
        specs = fsdp_specs(params, mesh, data_axis=lay.data_axis, expert_axis=lay.expert_axis)
        fsdp = nn.FSDP(lay.data_axis, specs)
    optimizer = optax.adamw(1e-4, weight_decay=0.1)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = optimizer_specs(optimizer, state, specs)
    context = dcp.ContextParallel("cp")
    coef = cfg.router_aux_loss_coef
    dp = mesh.shape["dp"]

    def local(params, inputs, targets):
        if precision == "mixed":
            params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        m = eqx.combine(params, static)
        if loss_chunk:  # the chunked loss: the (tokens, vocab) logits never held
            hidden, stats = m.hidden_states(
                inputs[0], cp=context, expert_axis=lay.expert_axis, fsdp=fsdp, remat="layer"
            )
            weight = m.head_weight(fsdp)
            mean, _ = chunked_causal_lm_loss(
                hidden, weight, targets[0], chunk_size=loss_chunk, axis_name=("dp", "cp")
            )
            assert stats is not None
            return mean + coef * nn.load_balancing_loss(jax.lax.psum(stats, ("dp", "cp")))
        logits, stats = m.logits_and_router_stats(
            inputs[0], cp=context, expert_axis=lay.expert_axis, fsdp=fsdp, remat="layer"
        )
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, targets[0][:, None], axis=-1))
        nll, stats = jax.lax.psum((nll, stats), ("dp", "cp"))
        return nll / (dp * tokens) + coef * nn.load_balancing_loss(stats)

    seq = P("dp", "cp")
    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=P())

    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    batch = jax.ShapeDtypeStruct((dp, tokens), jnp.int32, sharding=NamedSharding(mesh, seq))
    arguments = (placed(params, specs, mesh), placed(state, state_specs, mesh), batch, batch)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    return jitted, arguments, params, specs, state, state_specs


def measure(
    model: str,
    cfg,
    cls,
    name: str,
    precision: str,
    mesh,
    tokens: int,
    hlo_dir: str | None,
    loss_chunk: int = 0,
) -> list:
    lay = layout(name)
    jitted, arguments, params, specs, state, state_specs = build(
        model, cfg, cls, lay, precision, mesh, tokens, loss_chunk
    )
    # Optax's step count mixes ints and floats: lowered under standard promotion.
    c = Compiled(jitted, *arguments, standard_promotion=True)
    compiled = c.compiled
    hlo = compiled.as_text() or ""
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        path = os.path.join(hlo_dir, f"{model}_{name}_{precision}_{tokens}.hlo")
        with open(path, "w") as f:
            f.write(hlo)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    accessed = float((cost or {}).get("bytes accessed", float("nan")))
    cp = mesh.shape["cp"]
    counts = parameter_counts(params, cfg)
    flops, moe, attention = step_flops(hlo, cfg, lay, mesh, tokens)
    flops /= tokens // cp
    print(f"  ({moe} runs of the experts' loops, {attention} of attention's)")
    reference = model_flops_per_token(cfg, counts["active"], tokens)
    full = len(cfg.layer_types) == MODELS[model][2]["num_hidden_layers"]
    return [
        TITLES[model] if full else f"{TITLES[model]} ({len(cfg.layer_types)} layers)",
        f"{name}, loss chunks {loss_chunk}" if loss_chunk else name,
        precision,
        tokens,
        f"{shard_bytes(params, specs, mesh) / GiB:.2f}",
        f"{shard_bytes(state, state_specs, mesh) / GiB:.2f}",
        f"{c.arguments / GiB:.2f}",
        f"{c.outputs / GiB:.2f}",
        f"{c.temporaries / GiB:.2f}",
        f"{c.peak / GiB:.2f}",
        "yes" if c.peak <= FIT else "no",
        f"{flops / 1e9:.2f}",
        f"{reference / 1e9:.2f}",
        f"{flops / reference:.2f}",
        f"{accessed / 1e9:.1f}",
        f"{c.lower_seconds:.0f}",
        f"{c.compile_seconds:.0f}",
    ]


HEADERS = [
    "model",
    "layout",
    "precision",
    "tokens/seq",
    "params GiB",
    "optimizer GiB",
    "arguments GiB",
    "outputs GiB",
    "temporaries GiB",
    "peak GiB",
    "fits 95 GiB",
    "matmul GFLOP/token",
    "6N+attn GFLOP/token",
    "ratio",
    "GB accessed",
    "lower s",
    "compile s",
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="80b", help="80b, 35b or both (comma-separated)")
    parser.add_argument("--seq", default="4096", help="tokens per sequence, comma-separated")
    parser.add_argument("--layout", default="ep64", help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--precision", default="mixed", help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--dp", type=int, default=16, help="data ranks (one sequence each)")
    parser.add_argument("--cp", type=int, default=4, help="context ranks per sequence")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (debugging)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 512 tokens")
    parser.add_argument("--hlo", default=None, help="a folder to write each compiled HLO to")
    parser.add_argument(
        "--loss-chunk",
        type=int,
        default=0,
        help="the chunked loss (chunked_causal_lm_loss) at this many tokens per chunk; "
        "0 (default): the full logits",
    )
    args = parser.parse_args(argv)
    if args.dp * args.cp > len(jax.devices()):
        parser.error(f"--dp x --cp is more than the {len(jax.devices())} devices")
    mesh = make_mesh((args.dp, args.cp), ("dp", "cp"))
    models = args.model.split(",")
    seqs = [512] if args.quick else [int(s) for s in args.seq.split(",")]
    layouts = args.layout.split(",")
    precisions = args.precision.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            parser.error(f"--layout {name!r} is not one of {', '.join(LAYOUTS)}")
    for p in precisions:
        if p not in PRECISIONS:
            parser.error(f"--precision {p!r} is not one of {', '.join(PRECISIONS)}")
    print(f"jax {jax.__version__}; {machine_line()}")
    print(f"mesh dp={args.dp} x cp={args.cp} of {len(jax.devices())} simulated CPU devices")
    rows = []
    for model in models:
        cls, cfg = config(model, args.quick, args.layers)
        abstract = eqx.filter_eval_shape(
            lambda: cls(cfg, chunk_size=64, scan_layers=True, key=jr.key(0))
        )
        counts = parameter_counts(eqx.filter(abstract, is_struct), cfg)
        print(
            f"{TITLES[model]}{' (quick sizes)' if args.quick else ''}: "
            f"{len(cfg.layer_types)} layers, {counts['total'] / 1e9:.2f} B parameters "
            f"({counts['experts'] / 1e9:.2f} B routed experts, {counts['embedding'] / 1e9:.2f} B "
            f"embedding), {counts['active'] / 1e9:.2f} B active",
            flush=True,
        )
        for tokens in seqs:
            for name in layouts:
                for precision in precisions:
                    try:
                        row = measure(
                            model,
                            cfg,
                            cls,
                            name,
                            precision,
                            mesh,
                            tokens,
                            args.hlo,
                            args.loss_chunk,
                        )
                    except Exception as err:  # a failed compile is a finding: report it
                        message = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                        print(f"  {model} {name} {precision} {tokens}: FAILED {message}")
                        continue
                    rows.append(row)
                    print("  " + " | ".join(str(c) for c in row), flush=True)
    print_table(
        HEADERS,
        rows,
        title=f"Per device, a training step (loss, gradients, AdamW) on dp={args.dp} x "
        f"cp={args.cp}, one sequence per data rank, remat='layer', layers scanned",
    )
    print(f"machine after: {machine_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

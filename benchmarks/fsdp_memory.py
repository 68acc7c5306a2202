"""What fully sharded data parallelism saves per device: a small Qwen3.5-MoE model's AdamW
training step compiled for dp = 2, 4 and 8 simulated devices with its parameters replicated,
with the experts split over the data axis (`deltanet_cp.nn.expert_partition_specs`), and
with every parameter split (`deltanet_cp.nn.partition_specs(..., data_axis="dp")`, with and
without the experts over the axis), never run.

The model (`Qwen3_5MoeForCausalLM`, float32): hidden 512, vocabulary 8192 (untied LM
head), two layers (a Gated DeltaNet one of 4 key and 8 value heads of 64, a gated attention
one of 8 query and 2 key/value heads of 64), each with a sparse MoE block of 16 experts of
width 256 (top 2) and a shared expert of width 512: about 23 million parameters, most in
the experts, the embedding and the head. One sequence of `--tokens` per data rank (the
batch over `"dp"`), the loss the mean next-token cross entropy plus the load-balancing
loss, one `optax.adamw` step (its moments placed as their parameters, through
`optax.tree_utils.tree_map_params`). The parameters and optimizer state are donated.

Built abstractly (`equinox.filter_eval_shape`), inputs `jax.ShapeDtypeStruct`s with their
shardings, each program only lowered and compiled (`jax.jit(...).lower(...).compile()`) on
simulated CPU devices: nothing is allocated.

Per device, from the specs: the parameters' and the optimizer state's bytes (Adam's two
moments; the step count). From the compiled program's `memory_analysis()`: its arguments
(parameters, optimizer state, tokens), outputs, the outputs that alias donated arguments,
temporaries, and the peak the program can need, arguments + outputs - aliased +
temporaries. Under FSDP each layer runs through `FSDP.apply`, which gathers its weights
again in the backward rather than keeping them; XLA:CPU would merge the two gathers (it
drops the optimization barriers that keep them apart, which GPU and TPU keep), so this
script compiles with that pass off (`--xla_disable_hlo_passes=cse_barrier_expander`).

    python benchmarks/fsdp_memory.py            # dp = 2, 4, 8 (a few minutes)
    python benchmarks/fsdp_memory.py --quick    # tiny model, dp = 2: a smoke test
"""

import os


# XLA:CPU drops optimization barriers before common-subexpression elimination, which then
# merges the backward's repeated all-gathers into the forward's (keeping the gathered weights
# alive); GPU and TPU keep the barriers. Keep them here too, to measure what those compile.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_disable_hlo_passes=cse_barrier_expander"
).strip()


import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from _common import machine_line, print_table  # noqa: E402
from _impls import import_ours  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402


import_ours()

from deltanet_cp import nn  # noqa: E402
from deltanet_cp.models import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM  # noqa: E402


MiB = 2**20
LAYOUTS = ("replicated", "experts over dp", "FSDP", "FSDP + experts over dp")


def config(quick: bool) -> Qwen3_5MoeConfig:
    if quick:
        return Qwen3_5MoeConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            layer_types=("linear_attention", "full_attention"),
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
        )
    return Qwen3_5MoeConfig(
        vocab_size=8192,
        hidden_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        layer_types=("linear_attention", "full_attention"),
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=512,
    )


def specs_of(layout: str, params, mesh):
    """The parameters' specs of `layout` on `mesh`, and the `fsdp=` / `expert_axis=` of the
    model's call."""
    if layout == "replicated":
        return jax.tree.map(lambda _: P(), params), None, None
    if layout == "experts over dp":
        return nn.expert_partition_specs(params, "dp"), None, "dp"
    expert_axis = "dp" if layout == "FSDP + experts over dp" else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = nn.partition_specs(params, mesh, data_axis="dp", expert_axis=expert_axis)
    for w in caught:
        print(f"  ({layout}, dp={mesh.shape['dp']}: {w.message})")
    return specs, nn.FSDP("dp", specs), expert_axis


def shard_bytes(tree, specs, mesh) -> int:
    """The bytes one device holds of `tree` placed by `specs`."""
    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=_is_spec)):
        split = 1
        for entry in s:
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            split *= math.prod(mesh.shape[a] for a in names)
        total += math.prod(x.shape) // split * x.dtype.itemsize
    return total


def _is_spec(x) -> bool:
    return isinstance(x, P)


def measure(cfg: Qwen3_5MoeConfig, dp: int, layout: str, tokens: int) -> list:
    mesh = jax.make_mesh((dp,), ("dp",), devices=jax.devices()[:dp], axis_types=(AxisType.Auto,))
    model = eqx.filter_eval_shape(lambda: Qwen3_5MoeForCausalLM(cfg, chunk_size=64, key=jr.key(0)))
    is_param = lambda x: isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    params, static = eqx.partition(model, is_param)
    specs, fsdp, expert_axis = specs_of(layout, params, mesh)
    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, s: s,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=_is_spec,
    )

    def local(params, inputs, targets):
        m = eqx.combine(params, static)
        kw = dict(expert_axis=expert_axis, fsdp=fsdp)
        logits, stats = jax.vmap(lambda t: m.logits_and_router_stats(t, **kw))(inputs)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1))
        stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
        nll, count, stats = jax.lax.psum((nll, jnp.float32(targets.size), stats), "dp")
        return nll / count + cfg.router_aux_loss_coef * nn.load_balancing_loss(stats)

    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=P())

    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    def placed(tree, specs):
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
            tree,
            specs,
        )

    batch = jax.ShapeDtypeStruct((dp, tokens), jnp.int32, sharding=NamedSharding(mesh, P("dp")))
    start = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        compiled = (
            jax.jit(step, donate_argnums=(0, 1))
            .lower(placed(params, specs), placed(state, state_specs), batch, batch)
            .compile()
        )
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    assert mem is not None
    held = shard_bytes(params, specs, mesh), shard_bytes(state, state_specs, mesh)
    args, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
    alias, temp = mem.alias_size_in_bytes, mem.temp_size_in_bytes
    peak = args + out - alias + temp
    return [
        dp,
        layout,
        f"{held[0] / MiB:.1f}",
        f"{held[1] / MiB:.1f}",
        f"{args / MiB:.1f}",
        f"{out / MiB:.1f}",
        f"{alias / MiB:.1f}",
        f"{temp / MiB:.1f}",
        f"{peak / MiB:.1f}",
        f"{seconds:.0f}",
    ]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, dp = 2")
    parser.add_argument("--dp", default="2,4,8", help="data-parallel sizes")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence")
    args = parser.parse_args(argv)
    cfg = config(args.quick)
    sizes = [2] if args.quick else [int(d) for d in args.dp.split(",")]
    tokens = 16 if args.quick else args.tokens
    params = eqx.filter_eval_shape(lambda: Qwen3_5MoeForCausalLM(cfg, chunk_size=64, key=jr.key(0)))
    count = sum(
        math.prod(x.shape) for x in jax.tree.leaves(params) if isinstance(x, jax.ShapeDtypeStruct)
    )
    print(machine_line())
    print(
        f"Qwen3_5MoeForCausalLM, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts: {count / 1e6:.2f} M parameters (float32), one sequence "
        f"of {tokens} tokens per data rank; an AdamW step"
    )
    rows = [measure(cfg, dp, layout, tokens) for dp in sizes for layout in LAYOUTS]
    print_table(
        [
            "dp",
            "layout",
            "params MiB/dev",
            "optimizer MiB/dev",
            "arguments MiB",
            "outputs MiB",
            "aliased MiB",
            "temporaries MiB",
            "peak MiB",
            "compile s",
        ],
        rows,
        title="Per device: held (from the specs) and the compiled step's memory_analysis()",
    )


if __name__ == "__main__":
    main()

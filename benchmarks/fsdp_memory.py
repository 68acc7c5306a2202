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

import argparse
import math
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import simulate_cpu_devices  # noqa: E402


simulate_cpu_devices(8)  # before jax is imported

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    Compiled,
    fsdp_specs,
    is_struct,
    machine_line,
    make_mesh,
    MiB,
    optimizer_specs,
    placed,
    print_table,
    shard_bytes,
)
from _impls import import_ours  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402


import_ours()

from deltanet_cp import nn  # noqa: E402
from deltanet_cp.models import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM  # noqa: E402


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
    note = f"{layout}, dp={mesh.shape['dp']}: "
    specs = fsdp_specs(params, mesh, note=note, data_axis="dp", expert_axis=expert_axis)
    return specs, nn.FSDP("dp", specs), expert_axis


def measure(cfg: Qwen3_5MoeConfig, dp: int, layout: str, tokens: int) -> list:
    mesh = make_mesh((dp,), ("dp",))
    model = eqx.filter_eval_shape(lambda: Qwen3_5MoeForCausalLM(cfg, chunk_size=64, key=jr.key(0)))
    params, static = eqx.partition(model, is_struct)
    specs, fsdp, expert_axis = specs_of(layout, params, mesh)
    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(optimizer.init, params)
    state_specs = optimizer_specs(optimizer, state, specs)

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

    batch = jax.ShapeDtypeStruct((dp, tokens), jnp.int32, sharding=NamedSharding(mesh, P("dp")))
    arguments = (placed(params, specs, mesh), placed(state, state_specs, mesh), batch, batch)
    # Optax's step counts mix ints and floats: compiled under standard promotion.
    c = Compiled(jax.jit(step, donate_argnums=(0, 1)), *arguments, standard_promotion=True)
    held = shard_bytes(params, specs, mesh), shard_bytes(state, state_specs, mesh)
    return [
        dp,
        layout,
        f"{held[0] / MiB:.1f}",
        f"{held[1] / MiB:.1f}",
        f"{c.arguments / MiB:.1f}",
        f"{c.outputs / MiB:.1f}",
        f"{c.aliased / MiB:.1f}",
        f"{c.temporaries / MiB:.1f}",
        f"{c.peak / MiB:.1f}",
        f"{c.seconds:.0f}",
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
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params) if is_struct(x))
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

"""Train a small Qwen3-Next mixture-of-experts model with the batch over a data axis, the
sequence over a context axis and the routed experts split over either or both.

    python examples/train_moe.py --steps 5

A random Qwen3-Next model (three Gated DeltaNet layers and one attention layer, 8 routed
experts, top-2, a shared expert) trained with optax's Adam for a few steps from the same
seed in every configuration: the batch of two sequences over `"dp"` (two ranks), each
sequence over `"cp"` (1, 2 or 4 ranks, zigzag shards: every layer runs on them) and the
routed experts split 1, 2 or 4 ways over `"dp"`, `"cp"` or both (each device then holds
only its share of the experts' weights). The loss is the mean next-token cross entropy plus
`router_aux_loss_coef` times the load-balancing loss, the routing counted over the whole
batch. The printed losses agree across the configurations to float32 rounding.
"""

import os


if __name__ == "__main__":  # before jax is imported: enough simulated devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.models import Qwen3NextConfig, Qwen3NextForCausalLM
from deltanet_cp.nn import expert_partition_specs, load_balancing_loss


DP = 2
CONFIG = Qwen3NextConfig(
    vocab_size=128,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    intermediate_size=64,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=32,
    router_aux_loss_coef=0.01,
)
# (cp ranks, expert split) -> the mesh axes the experts are split over on a (dp=2, cp) mesh.
SPLITS = {
    (1, 1): None,
    (1, 2): "dp",
    (2, 1): None,
    (2, 2): "cp",
    (2, 4): ("dp", "cp"),
    (4, 1): None,
    (4, 2): "dp",
    (4, 4): "cp",
}


def loss_fn(model, inputs, targets, cp=None, expert_axis=None):
    """This rank's sums: the next-token cross entropy, the token count and the routing
    statistics; `total` makes the loss of them, summed over every rank."""
    logits, stats = jax.vmap(
        lambda t: model.logits_and_router_stats(t, cp=cp, expert_axis=expert_axis)
    )(inputs)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))
    stats = jax.tree.map(lambda a: jnp.sum(a, axis=0), stats)
    return nll, jnp.asarray(targets.size, jnp.float32), stats


def total(model, nll, count, stats):
    return nll / count + model.config.router_aux_loss_coef * load_balancing_loss(stats)


def make_loss(static, cp: int, split: int):
    """The training loss of a batch `(DP, seq)` in sequence order, and the parameters'
    placement on the mesh."""
    axis = SPLITS[(cp, split)]
    mesh = jax.make_mesh(
        (DP, cp), ("dp", "cp"), devices=jax.devices()[: DP * cp], axis_types=(AxisType.Auto,) * 2
    )
    layout = dcp.Zigzag()
    context = dcp.ContextParallel("cp", layout=layout) if cp > 1 else None

    def specs(params):
        return expert_partition_specs(params, axis) if axis else jax.tree.map(lambda _: P(), params)

    def per_rank(params, inputs, targets):
        model = eqx.combine(params, static)
        sums = jax.lax.psum(loss_fn(model, inputs, targets, context, axis), ("dp", "cp"))
        return total(model, *sums)

    def loss(params, inputs, targets):
        if cp > 1:  # zigzag shards: rank r holds pieces r and 2 cp - 1 - r
            inputs, targets = layout.to_layout(inputs, cp), layout.to_layout(targets, cp)
        seq = P("dp", "cp")
        return jax.shard_map(
            per_rank, mesh=mesh, in_specs=(specs(params), seq, seq), out_specs=P()
        )(params, inputs, targets)

    def place(params):
        return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs(params)))

    return loss, place


def data(steps: int, length: int) -> np.ndarray:
    """`(steps, DP, length + 1)` token ids: rows counting up by a stride of 1 to 3."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, CONFIG.vocab_size, (steps, DP, 1))
    stride = rng.integers(1, 4, (steps, DP, 1))
    return ((first + stride * np.arange(length + 1)) % CONFIG.vocab_size).astype(np.int32)


def train(cp: int, split: int, steps: int, length: int, lr: float = 3e-3) -> list[float]:
    """The losses of `steps` Adam steps of learning rate `lr` from the same seed, in one
    configuration."""
    model = Qwen3NextForCausalLM(CONFIG, chunk_size=8, key=jr.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    loss, place = make_loss(static, cp, split)
    optimizer = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens[:, :-1], tokens[:, 1:])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    params = place(params)
    # optax makes its step count on one device, and the step returns it on the mesh: put it
    # there first, or the second step compiles the step again.
    replicated = NamedSharding(jax.tree.leaves(params)[0].sharding.mesh, P())
    opt_state = jax.tree.map(
        lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, replicated),
        optimizer.init(params),
    )
    losses = []
    for tokens in data(steps, length):
        value, params, opt_state = step(params, opt_state, jnp.asarray(tokens))
        losses.append(float(value))
    return losses


def main(
    configs=tuple(SPLITS),
    steps: int = 5,
    length: int = 32,
    verbose: bool = True,
    lr: float = 3e-3,
) -> dict[tuple[int, int], list[float]]:
    """Train in each `(cp, expert split)` of `configs`; the losses per configuration."""
    results = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        for cp, split in configs:
            results[(cp, split)] = train(cp, split, steps, length, lr)
            if verbose:
                losses = " ".join(f"{v:.6f}" for v in results[(cp, split)])
                axis = SPLITS[(cp, split)]
                print(f"dp={DP} cp={cp} experts split {split} ways (over {axis}): {losses}")
    if verbose:
        first = np.asarray(next(iter(results.values())))
        worst = max(np.max(np.abs(np.asarray(v) - first) / first) for v in results.values())
        print(f"largest relative difference from the first configuration: {worst:.1e}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--length", type=int, default=32, help="tokens per sequence")
    parser.add_argument(
        "--lr",
        type=float,
        default=3e-3,
        help="Adam's learning rate (at 1e-2 the curves of different cp drift apart: the "
        "router's top-k turns float32 rounding into other experts)",
    )
    args = parser.parse_args()
    main(steps=args.steps, length=args.length, lr=args.lr)

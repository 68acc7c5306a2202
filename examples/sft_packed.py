"""Supervised fine-tuning of a small Qwen3.5-MoE model on packed documents, with the rows
over a data axis, each row over a context axis and the routed experts split.

    python examples/sft_packed.py --steps 8

Prompt / answer pairs of different lengths (the answer is the prompt's tokens, one up,
after a separator) are packed by `deltanet_cp.data.pack_documents` into rows of 32 tokens,
their prompts masked out of the targets (`prompt_lengths`). A random Qwen3.5-MoE model (a
Gated DeltaNet layer and an attention layer, 8 routed experts, top-2, a shared expert)
is trained with optax's Adam from the same seed in each configuration: one device; two
rows at a time over `"dp"` and each row over `"cp"` (2 ranks) with every expert on every
rank; the experts split over both axes (each device holds 2 of the 8); zigzag shards with
the experts split over `"cp"`. Every layer treats each document as a sequence of its own
(`cu_seqlens=`); the loss is the mean cross entropy over the answers' tokens of the whole
batch (`causal_lm_loss`, a `psum` of sums and counts) plus `router_aux_loss_coef` times the
load-balancing loss over the real tokens (`real_tokens`, padding excluded), as transformers
computes both. The printed loss curves agree across the configurations to float32
rounding.
"""

import os


if __name__ == "__main__":  # before jax is imported: enough simulated devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()

import argparse

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.data import (
    add_router_loss,
    causal_lm_loss,
    make_global_batch,
    pack_documents,
    PackedRows,
    real_tokens,
)
from deltanet_cp.models import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM
from deltanet_cp.nn import expert_partition_specs


CONFIG = Qwen3_5MoeConfig(
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
    router_aux_loss_coef=0.01,
)
ROW = 32  # tokens per row: a multiple of 2 * cp for zigzag
ROWS = 4  # rows per step
MAX_DOCUMENTS = 4  # per row: `cu_seqlens` is (ROWS, 6) every step, so one compilation
SEP = 1  # the separator between a prompt and its answer
# name -> (dp, cp, layout, the mesh axes the experts are split over)
CONFIGS = {
    "1 device": (1, 1, dcp.Contiguous(), None),
    "dp2 x cp2": (2, 2, dcp.Contiguous(), None),
    "dp2 x cp2, experts over dp and cp": (2, 2, dcp.Contiguous(), ("dp", "cp")),
    "dp2 x cp2 zigzag, experts over cp": (2, 2, dcp.Zigzag(), "cp"),
}


def documents(count: int, seed: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """`count` prompt / answer documents and their prompt lengths: a prompt of 2 to 6
    tokens (ids 2 to 17), the separator, then the prompt's tokens each one up (the answer,
    to learn)."""
    rng = np.random.default_rng(seed)
    docs, prompts = [], []
    for _ in range(count):
        prompt = rng.integers(2, 18, rng.integers(2, 7))
        docs.append(np.concatenate([prompt, [SEP], prompt + 1]).astype(np.int32))
        prompts.append(prompt.size + 1)  # the separator is the prompt's last token
    return docs, prompts


def batches(steps: int) -> list[PackedRows]:
    """`steps` batches of `ROWS` packed rows each (NumPy, sequence order)."""
    docs, prompts = documents(steps * ROWS * 4)
    packed = pack_documents(docs, ROW, prompt_lengths=prompts, max_documents=MAX_DOCUMENTS)
    if packed.tokens.shape[0] < steps * ROWS:
        raise ValueError("Too few documents for the steps: raise the count in `batches`.")
    return [PackedRows(*(a[i * ROWS : (i + 1) * ROWS] for a in packed)) for i in range(steps)]


def make_loss(static, dp: int, cp: int, layout: dcp.AbstractLayout, expert_axis):
    """The training loss of a global batch on a `(dp, cp)` mesh, the parameters'
    placement, and how a NumPy batch becomes the global arrays the loss takes."""
    mesh = jax.make_mesh((dp, cp), ("dp", "cp"), devices=jax.devices()[: dp * cp])
    context = dcp.ContextParallel("cp", layout=layout) if cp > 1 else None
    axes = ("dp", "cp")

    def specs(params):
        if expert_axis is None:
            return jax.tree.map(lambda _: P(), params)
        return expert_partition_specs(params, expert_axis)

    def per_rank(params, batch: PackedRows):
        model = eqx.combine(params, static)
        mask = real_tokens(batch, cp=context)  # this rank's tokens that are no padding

        def row(tokens, cu_seqlens, mask):
            return model.logits_and_router_stats(
                tokens, cu_seqlens=cu_seqlens, token_mask=mask, cp=context, expert_axis=expert_axis
            )

        logits, stats = jax.vmap(row)(batch.tokens, batch.cu_seqlens, mask)
        loss, _ = causal_lm_loss(logits, batch.labels, axis_name=axes)
        return add_router_loss(loss, stats, CONFIG.router_aux_loss_coef, axis_name=axes)

    def loss(params, batch: PackedRows):
        token, row = P("dp", "cp"), P("dp", None)
        in_specs = (specs(params), PackedRows(token, token, row, row, row))
        return jax.shard_map(per_rank, mesh=mesh, in_specs=in_specs, out_specs=P())(params, batch)

    def place(params):
        return jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs(params)))

    def global_batch(packed: PackedRows) -> PackedRows:
        # Each process gives its own block; tokens and labels in the layout's order.
        return make_global_batch(packed, mesh, layout, data_axis="dp", context_axis="cp")

    return loss, place, global_batch


def train(name: str, steps: int, lr: float = 1e-2) -> list[float]:
    """The losses of `steps` Adam steps from the same seed in configuration `name`."""
    dp, cp, layout, expert_axis = CONFIGS[name]
    model = Qwen3_5MoeForCausalLM(CONFIG, chunk_size=8, key=jr.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    loss, place, global_batch = make_loss(static, dp, cp, layout, expert_axis)
    optimizer = optax.adam(lr)

    @jax.jit
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
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
    for packed in batches(steps):
        value, params, opt_state = step(params, opt_state, global_batch(packed))
        losses.append(float(value))
    return losses


def main(
    configs=tuple(CONFIGS), steps: int = 8, verbose: bool = True, lr: float = 1e-2
) -> dict[str, list[float]]:
    """Train in each configuration of `configs`; the loss curve per configuration."""
    results = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        for name in configs:
            results[name] = train(name, steps, lr)
            if verbose:
                print(f"{name:>34}: " + " ".join(f"{v:.5f}" for v in results[name]))
    if verbose:
        first = np.asarray(next(iter(results.values())))
        worst = max(np.max(np.abs(np.asarray(v) - first) / first) for v in results.values())
        print(f"largest relative difference from the first configuration: {worst:.1e}")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument(
        "--configs",
        nargs="*",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="the configurations to train (default: all)",
    )
    args = parser.parse_args()
    main(configs=tuple(args.configs), steps=args.steps, lr=args.lr)

"""Kimi Linear: train a few steps with context parallelism and the experts split, generate,
and round-trip the checkpoint.

    python examples/kimi_linear.py                      # a tiny random model (CPU: about
                                                        # 70 s on 2 cores, mostly compiling)
    python examples/kimi_linear.py --checkpoint DIR     # a Kimi Linear checkpoint folder

The model's Kimi Delta Attention and latent attention layers run on zigzag shards of each
sequence over a `"cp"` mesh axis, its routed experts are split over the same axis (each
rank holds `E / cp` of them), the loss is the mean next-token cross entropy on a counting
task; then greedy decoding, and `save_pretrained` / `from_pretrained` give back the same
parameters.
"""

import os


if __name__ == "__main__":  # before jax is imported: enough simulated devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.models import KimiLinearConfig, KimiLinearForCausalLM
from deltanet_cp.nn import expert_partition_specs


# A tiny Kimi Linear: KDA, multi-head latent attention, KDA; the first layer with a dense
# MLP, then 8 experts in 2 groups (the best group kept), 2 per token, and a shared expert.
TINY = KimiLinearConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    linear_num_heads=2,
    linear_head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
)


def counting(rng, batch: int, length: int, vocab: int) -> np.ndarray:
    """`(batch, length)` token ids counting up from a random token by a stride of 1 to 3."""
    first = rng.integers(0, vocab, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    return ((first + stride * np.arange(length)) % vocab).astype(np.int32)


def main(
    checkpoint: str | None = None,
    cp: int = 2,
    steps: int = 5,
    batch: int = 2,
    length: int = 32,
    verbose: bool = True,
) -> dict:
    say = print if verbose else (lambda *a, **k: None)
    if checkpoint is None:
        model = KimiLinearForCausalLM(TINY, chunk_size=8, key=jr.key(0))
    else:
        model = KimiLinearForCausalLM.from_pretrained(checkpoint)
    vocab = model.config.vocab_size
    layout = dcp.Zigzag()
    context = dcp.ContextParallel("cp", layout=layout)
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp], axis_types=(AxisType.Auto,))
    params, static = eqx.partition(model, eqx.is_array)
    # Every parameter whole on every rank but the routed experts, split over "cp".
    specs = expert_partition_specs(params, "cp")
    params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))

    def local(params, inputs, targets):
        m = eqx.combine(params, static)
        logits = jax.vmap(lambda t: m(t, cp=context, expert_axis="cp"))(inputs)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        return jax.lax.psum(nll, "cp") / (targets.shape[0] * targets.shape[1] * cp)

    seq = P(None, "cp")
    loss = jax.shard_map(local, mesh=mesh, in_specs=(specs, seq, seq), out_specs=P())
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    rng = np.random.default_rng(0)
    # optax makes its step count on one device, and the step returns it on the mesh: put it
    # there first, or the second step compiles the step again.
    replicated = NamedSharding(mesh, P())
    opt_state = jax.tree.map(
        lambda a: a if isinstance(a.sharding, NamedSharding) else jax.device_put(a, replicated),
        optimizer.init(params),
    )
    losses = []
    for i in range(steps):
        data = counting(rng, batch, length + 1, vocab)
        inputs, targets = (jnp.asarray(a) for a in (data[:, :-1], data[:, 1:]))
        inputs, targets = layout.to_layout(inputs, cp), layout.to_layout(targets, cp)
        start = time.perf_counter()
        value, params, opt_state = step(params, opt_state, inputs, targets)
        losses.append(float(value))
        say(f"step {i}: loss {losses[-1]:.4f} ({time.perf_counter() - start:.2f} s)")
    model = eqx.combine(jax.device_get(params), static)
    prompt = jnp.asarray(counting(rng, 1, 8, vocab)[0])
    generated = model.generate(prompt, 8)
    say("prompt   ", np.asarray(prompt).tolist())
    say("generated", np.asarray(generated).tolist())
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        chunk = model.layers[0].mixer.options.chunk_size
        back = KimiLinearForCausalLM.from_pretrained(folder, chunk_size=chunk)
        same = bool(eqx.tree_equal(back, model))
    say("save_pretrained -> from_pretrained gives the same parameters:", same)
    return {"losses": losses, "generated": generated, "round_trip": same}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="a Kimi Linear checkpoint folder")
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        main(args.checkpoint, args.cp, args.steps)

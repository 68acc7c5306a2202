"""Fine-tune a Qwen3.5 checkpoint with context parallelism, then serve it: a context-parallel
prefill that also saves the recurrent states every few tokens, and greedy decoding.

    python examples/finetune_qwen3_5.py --cp 4 --steps 60

By default it loads the tiny random checkpoint this repository ships (`tests/data/qwen3_5_lm`,
saved by transformers' `Qwen3_5ForCausalLM.save_pretrained`); pass `--checkpoint DIR` for
another directory with a `config.json` and safetensors weights. The task: sequences that
count up from a random token by a random stride (1, 2 or 3), which the model must read from
the tokens before; the loss falls and the generated continuation keeps counting.
"""

import os


if __name__ == "__main__":  # before jax is imported: enough simulated devices
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.models import Qwen3_5ForCausalLM


CHECKPOINT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "qwen3_5_lm"
# Every layer sharded over the "cp" mesh axis in zigzag order: rank r holds pieces r and
# 2 cp - 1 - r of the sequence, which balances the attention layers' causal work.
ZIGZAG = dcp.ContextParallel("cp", layout=dcp.Zigzag())


def counting(rng, batch: int, length: int, vocab: int) -> np.ndarray:
    """`(batch, length)` token ids, each row counting up from a random token by a random
    stride of 1, 2 or 3 (modulo the vocabulary): after two tokens every next one follows."""
    first = rng.integers(0, vocab, (batch, 1))
    stride = rng.integers(1, 4, (batch, 1))
    return ((first + stride * np.arange(length)) % vocab).astype(np.int32)


def make_loss(static, cp: int, mesh):
    """Mean next-token cross entropy over a batch `(batch, seq)`, the sequence sharded over
    `cp` ranks in zigzag order (every layer runs on the zigzag shards)."""

    def nll(model, inputs, targets, context=None):
        logits = jax.vmap(lambda t: model(t, cp=context))(inputs).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], axis=-1))

    if cp == 1:
        return lambda params, inputs, targets: (
            nll(eqx.combine(params, static), inputs, targets) / targets.size
        )

    def local(params, inputs, targets):
        model = eqx.combine(params, static)
        total = nll(model, inputs, targets, context=ZIGZAG)
        return jax.lax.psum(total, "cp") / (targets.size * cp)

    seq = P(None, "cp")
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq), out_specs=P())


def main(
    checkpoint: str | os.PathLike = CHECKPOINT,
    *,
    cp: int = 4,
    steps: int = 60,
    batch: int = 8,
    seq_len: int = 64,
    learning_rate: float = 1e-2,
    checkpoint_every: int = 8,
    new_tokens: int = 16,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Fine-tune, then prefill and decode. Returns the losses, the generated tokens and the
    fraction of them that keep counting."""
    say = print if verbose else (lambda *a, **k: None)
    model = Qwen3_5ForCausalLM.from_pretrained(checkpoint, chunk_size=8)
    say(f"loaded {checkpoint}: {model.config.layer_types}")
    vocab = model.config.vocab_size
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    params, static = eqx.partition(model, eqx.is_array)
    loss = make_loss(static, cp, mesh)
    optimiser = optax.adamw(learning_rate)
    # Replicated from the start, as every step returns them: one compilation, not two.
    params, opt_state = jax.device_put((params, optimiser.init(params)), NamedSharding(mesh, P()))

    @jax.jit
    def step(params, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(params, inputs, targets)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    rng = np.random.default_rng(seed)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        tokens = counting(rng, batch, seq_len + 1, vocab)
        inputs, targets = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
        if cp > 1:  # zigzag order once, then shard the sequence: rank r holds pieces r, 2cp-1-r
            inputs, targets = (
                jax.device_put(dcp.to_zigzag(a, cp), NamedSharding(mesh, P(None, "cp")))
                for a in (inputs, targets)
            )
        params, opt_state, value = step(params, opt_state, inputs, targets)
        losses.append(float(value))
        if i % 10 == 0 or i == steps - 1:
            say(f"step {i:3d}  loss {losses[-1]:.4f}  ({time.perf_counter() - start:.1f}s)")
    model = eqx.combine(params, static)

    # Serving: a context-parallel prefill of a prompt, saving the Gated DeltaNet states every
    # `checkpoint_every` tokens, then greedy decoding on one device from the cache.
    whole = counting(rng, 1, seq_len + new_tokens, vocab)[0]
    prompt = jnp.asarray(whole[:seq_len])

    def prefill(params, tokens):
        m = eqx.combine(params, static)
        return m.prefill(
            tokens,
            capacity=seq_len + new_tokens,
            checkpoint_every=checkpoint_every,
            cp=ZIGZAG,
        )

    sharded_prefill = jax.jit(
        jax.shard_map(
            prefill, mesh=mesh, in_specs=(P(), P("cp")), out_specs=(P("cp"), P(), P("cp"))
        )
    )
    sharded = jax.device_put(dcp.to_zigzag(prompt, cp, axis=0), NamedSharding(mesh, P("cp")))
    logits, cache, saved = sharded_prefill(params, sharded)
    saved = jax.tree.map(lambda a: dcp.from_zigzag(a, cp, axis=0), saved)  # sequence order
    ends = saved.lengths.tolist()
    say(f"prefill of {seq_len} tokens on {cp} ranks; checkpoints after {ends} tokens")
    token = jnp.argmax(dcp.from_zigzag(np.asarray(logits), cp, axis=0)[-1])
    generated = []
    for _ in range(new_tokens):
        generated.append(int(token))
        step_logits, cache = model.decode_step(token, cache)
        token = jnp.argmax(step_logits)
    expected = whole[seq_len:]
    accuracy = float(np.mean(np.asarray(generated) == expected))
    say(f"generated {generated}\nexpected  {expected.tolist()}\naccuracy  {accuracy:.2f}")
    return {"losses": losses, "generated": generated, "accuracy": accuracy, "checkpoints": saved}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint", default=str(CHECKPOINT))
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    main(args.checkpoint, cp=args.cp, steps=args.steps)

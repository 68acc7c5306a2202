"""Mixed-precision training of the Qwen3.5 models: float32 against bfloat16 parameters-as-used
with float32 master weights and optimizer state (docs/guides/training_cp.md, "Mixed
precision"), on this machine's CPU.

    python benchmarks/mixed_precision.py                 # Qwen3.5 dense and MoE
    python benchmarks/mixed_precision.py --quick         # tiny models, a few steps
    python benchmarks/mixed_precision.py --models dense --steps 40 --seq 512

Each model (random parameters, float32; 4 layers, 3 Gated DeltaNet : 1 gated attention;
`--models moe`: Qwen3.5 MoE, a sparse block of 8 experts, top 2, and a shared expert in
every layer) takes one training step, `jax.jit`-compiled with the parameters and optimizer
state donated: the mean next-token cross entropy (plus the load-balancing loss of the MoE
model) of a batch, its gradient, one `optax.adamw` update. Two variants of the one step:

- **float32**: the parameters as they are (policy `"highest"`: exact float32 products);
- **mixed**: the float32 master parameters cast to bfloat16 inside the loss (every
  product then takes bfloat16 operands with float32 accumulation, the recurrent states, the
  decays, the norms and the softmaxes stay float32), the logits cast to float32 before the
  cross entropy; the gradients come back float32 through the cast, and AdamW's moments and
  update are float32.

Printed per model and variant: the compiled step's `memory_analysis()` (arguments: the
parameters, the optimizer state and the batch; temporaries), the median step time, and the
loss of the first and last steps. Both variants train from the same parameters on the same
batches (a toy language: each next token is an affine function of the previous one modulo
the vocabulary, or uniform with probability `NOISE`), the steps alternated A, B, B, A, ...
(`paired_times`): the time ratio is the median over the steps (the first skipped) of
mixed / float32, and the loss columns show how closely mixed tracks float32.

XLA:CPU has no bfloat16 matrix unit: its bfloat16 products and elementwise work are
converted to float32 and back, so the time column here says what the casts cost on a CPU,
not what an accelerator gains; the bytes are what the compiled program holds.
"""

import argparse
import os
import statistics
import sys
from typing import Any


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _common import (  # noqa: E402
    Compiled,
    machine_line,
    MiB,
    paired_times,
    print_table,
    small_qwen_sizes,
)
from _impls import import_ours  # noqa: E402


import_ours()

from deltanet_cp.models import (  # noqa: E402
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
)
from deltanet_cp.nn import load_balancing_loss  # noqa: E402


NOISE = 0.2  # the toy language's share of uniformly random next tokens
VARIANTS = ("float32", "mixed")


def config(model: str, hidden: int, vocab: int) -> tuple[Any, Any]:
    """The model's class and a 4-layer config of width `hidden`."""
    sizes: dict[str, Any] = small_qwen_sizes(vocab, hidden, 4, tied=False)
    if model == "dense":
        return Qwen3_5ForCausalLM, Qwen3_5Config(intermediate_size=3 * hidden, **sizes)
    return Qwen3_5MoeForCausalLM, Qwen3_5MoeConfig(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        **sizes,
    )


def bfloat16(tree):
    """Every floating-point array of `tree` cast to bfloat16; the rest as it is."""
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tree)


def step_fn(static, optimizer, mixed: bool):
    """One training step on float32 master parameters; `mixed`: computed in bfloat16."""

    def loss(params, tokens):
        model = eqx.combine(bfloat16(params) if mixed else params, static)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        if model.config.is_sparse(0):
            logits, stats = jax.vmap(model.logits_and_router_stats)(inputs)
            stats = jax.tree.map(lambda a: jnp.sum(a, 0), stats)
            aux = model.config.router_aux_loss_coef * load_balancing_loss(stats)
        else:
            logits, aux = jax.vmap(model)(inputs), 0.0
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))  # float32 cross entropy
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1)) + aux

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


def toy_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 0) -> np.ndarray:
    """`(steps, batch, seq + 1)` token ids: `x[t + 1] = (a x[t] + b) mod vocab`, or a
    uniformly random token with probability `NOISE`."""
    rng = np.random.default_rng(seed)
    x = np.empty((steps, batch, seq + 1), np.int32)
    x[..., 0] = rng.integers(0, vocab, (steps, batch))
    for t in range(seq):
        rule = (5 * x[..., t] + 3) % vocab
        noise = rng.integers(0, vocab, (steps, batch))
        x[..., t + 1] = np.where(rng.random((steps, batch)) < NOISE, noise, rule)
    return x


def measure(model: str, hidden: int, vocab: int, seq: int, batch: int, steps: int, lr: float):
    cls, cfg = config(model, hidden, vocab)
    params, static = eqx.partition(cls(cfg, chunk_size=64, key=jr.key(0)), eqx.is_array)
    optimizer = optax.adamw(lr)
    data = toy_batches(steps, batch, seq, vocab)
    programs = {
        v: Compiled(
            step_fn(static, optimizer, v == "mixed"), params, optimizer.init(params), data[0]
        )
        for v in VARIANTS
    }
    compiled = {v: c.compiled for v, c in programs.items()}
    # Each variant trains its own copy (the step donates it) from the same parameters.
    state = {v: jax.tree.map(jnp.copy, (params, optimizer.init(params))) for v in VARIANTS}
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    done = {v: 0 for v in VARIANTS}

    def call(variant: str) -> None:
        value, *new = compiled[variant](*state[variant], data[done[variant]])
        state[variant] = tuple(jax.block_until_ready(new))
        losses[variant].append(float(value))
        done[variant] += 1

    times = paired_times({v: (lambda v=v: call(v)) for v in VARIANTS}, steps)
    for v in VARIANTS:  # the master weights and the optimizer state stayed float32
        floats = [x for x in jax.tree.leaves(state[v]) if jnp.issubdtype(x.dtype, jnp.floating)]
        dtypes = {x.dtype for x in floats}
        assert dtypes == {jnp.dtype(jnp.float32)}, (v, dtypes)
    ratio = statistics.median(
        b / a for a, b in zip(times["float32"][1:], times["mixed"][1:])
    )  # the first step (warm-up) skipped
    rows = []
    for v in VARIANTS:
        c = programs[v]
        rows.append(
            [
                model,
                v,
                f"{c.arguments / MiB:.1f}",
                f"{c.temporaries / MiB:.1f}",
                f"{c.temporaries / programs['float32'].temporaries:.2f}",
                f"{c.seconds:.0f}",
                f"{1e3 * statistics.median(times[v][1:]):.0f}",
                "1.00" if v == "float32" else f"{ratio:.2f}",
                f"{losses[v][0]:.4f}",
                f"{losses[v][-1]:.4f}",
            ]
        )
    gap = max(abs(a - b) for a, b in zip(losses["float32"], losses["mixed"]))
    return rows, gap, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps")
    parser.add_argument("--models", default="dense,moe", help="dense, moe or both")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)  # every compile is a compile
    if args.quick:
        args.hidden, args.vocab, args.seq, args.steps = 32, 64, 128, 6
    print(f"{jax.devices()[0].platform}, {machine_line()}")
    rows, gaps = [], []
    for model in [m.strip() for m in args.models.split(",")]:
        out, gap, losses = measure(
            model, args.hidden, args.vocab, args.seq, args.batch, args.steps, args.lr
        )
        rows += out
        gaps.append(f"{model}: {gap:.4f}")
        for v in VARIANTS:
            print(f"  {model} {v} losses: " + " ".join(f"{x:.3f}" for x in losses[v]), flush=True)
    print_table(
        [
            "model",
            "step",
            "arguments MiB",
            "temp MiB",
            "temp / float32",
            "compile s",
            "step ms",
            "time / float32",
            "loss, step 1",
            f"loss, step {args.steps}",
        ],
        rows,
        title=(
            f"Training step (loss, gradient, AdamW), hidden {args.hidden}, vocabulary "
            f"{args.vocab}, 4 layers, {args.batch} x {args.seq} tokens; {args.steps} steps"
        ),
    )
    print(f"\nLargest |loss(mixed) - loss(float32)| over the steps: {', '.join(gaps)}")


if __name__ == "__main__":
    main()

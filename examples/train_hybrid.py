"""Train a tiny hybrid model (3 Gated DeltaNet : 1 softmax attention) on associative recall,
context-parallel over a mesh of simulated CPU devices.

    python examples/train_hybrid.py --cp 4 --steps 40

The same seed gives the same losses at every CP degree, up to float reduction order:
`examples/demo.py` runs this at cp = 1, 2, 4 and prints the losses side by side.
"""

import os


if __name__ == "__main__":  # before jax is imported: enough simulated devices (and see demo.py)
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import dataclasses
import functools as ft
from collections.abc import Callable, Iterator
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.nn import HybridLM


AXIS = "cp"


@dataclasses.dataclass(frozen=True)
class Config:
    vocab_size: int = 32
    hidden_size: int = 64
    num_layers: int = 4  # blocks 0-2: Gated DeltaNet, block 3: softmax attention
    seq_len: int = 256
    batch_size: int = 8
    num_pairs: int = 4  # key/value pairs per sequence for the recall task
    chunk_size: int = 64
    learning_rate: float = 5e-3
    warmup_steps: int = 10
    clip_norm: float = 1.0
    weight_decay: float = 0.01
    steps: int = 40
    seed: int = 0
    # The Gated DeltaNet layers' state exchange, and the attention layers' key/value one.
    exchange: Literal["allgather", "ppermute", "ring", "auto"] = "allgather"
    kv_schedule: Literal["allgather", "ring"] = "allgather"
    layout: str = "contiguous"  # or "zigzag": every layer on load-balanced shards


def make_model(cfg: Config, key) -> HybridLM:
    return HybridLM(
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.num_layers,
        num_key_heads=2,
        num_value_heads=4,
        key_head_dim=16,
        value_head_dim=16,
        num_attention_heads=4,
        attention_head_dim=16,
        intermediate_size=2 * cfg.hidden_size,
        chunk_size=cfg.chunk_size,
        key=key,
    )


def recall_batch(rng: np.random.Generator, cfg: Config) -> tuple[np.ndarray, ...]:
    """Associative recall: `k1 v1 k2 v2 ... kn vn` then queries `k v` about those pairs.

    Keys are tokens `[2, vocab/2)`, values `[vocab/2, vocab)`; each sequence draws its own
    mapping. The loss counts only the values that follow a query key: a model can only
    get them right by recalling the pair from earlier in the sequence.

    **Returns:**

    `(inputs, targets, mask)`, each `(batch, seq_len)`.
    """
    half = cfg.vocab_size // 2
    n = cfg.seq_len + 1
    tokens = np.zeros((cfg.batch_size, n), np.int32)
    is_answer = np.zeros((cfg.batch_size, n), bool)
    for b in range(cfg.batch_size):
        keys = rng.choice(np.arange(2, half), cfg.num_pairs, replace=False)
        values = rng.integers(half, cfg.vocab_size, cfg.num_pairs)
        n_queries = (n - 2 * cfg.num_pairs + 1) // 2
        which = rng.integers(0, cfg.num_pairs, n_queries)
        ks = np.concatenate([keys, keys[which]])
        vs = np.concatenate([values, values[which]])
        seq = np.stack([ks, vs], axis=1).reshape(-1)[:n]
        tokens[b, : seq.size] = seq
        answer = np.zeros(2 * ks.size, bool)
        answer[2 * cfg.num_pairs + 1 :: 2] = True
        is_answer[b, : seq.size] = answer[:n]
    return tokens[:, :-1], tokens[:, 1:], is_answer[:, 1:].astype(np.float32)


def batches(cfg: Config) -> Iterator[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(cfg.seed)
    while True:
        yield recall_batch(rng, cfg)


def _nll(logits, targets, mask):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask), jnp.sum(mask)


def context_parallel(cfg: Config) -> dcp.ContextParallel:
    """How every layer is sharded: over the `"cp"` mesh axis, in `cfg.layout`, the Gated
    DeltaNet layers exchanging state by `cfg.exchange`."""
    if cfg.layout == "contiguous":
        return dcp.ContextParallel(AXIS, exchange=cfg.exchange)
    if cfg.layout == "zigzag":
        return dcp.ContextParallel(AXIS, layout=dcp.Zigzag(), exchange=cfg.exchange)
    raise ValueError(f"layout must be 'contiguous' or 'zigzag'; got {cfg.layout!r}.")


def loss_fn(model: HybridLM, inputs, targets, mask, *, cp: int, mesh=None, cfg: Config):
    """Mean next-token cross entropy over the masked positions.

    Without `mesh`: the single-device path. With it: `jax.shard_map` over `mesh`, time
    sharded over its `"cp"` axis (under zigzag the batch arrives in zigzag order) and the
    batch over its `"dp"` axis if it has one; each rank sums its own positions and one
    `psum` over every axis combines them.
    """
    if mesh is None:
        total, count = _nll(jax.vmap(model)(inputs), targets, mask)
        return total / count
    params, static = eqx.partition(model, eqx.is_array)

    def local(params, inputs, targets, mask):
        m = eqx.combine(params, static)
        call = ft.partial(m, cp=context_parallel(cfg), kv_schedule=cfg.kv_schedule)
        logits = jax.vmap(call)(inputs)
        total, count = _nll(logits, targets, mask)
        return jax.lax.psum(total, mesh.axis_names) / jax.lax.psum(count, mesh.axis_names)

    seq = _batch_spec(mesh)
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq, seq), out_specs=P())
    return sharded(params, inputs, targets, mask)


def make_mesh(cp: int, dp: int = 1):
    """The mesh: `(cp,)` over `"cp"`; with `dp > 1`, `(dp, cp)` over `("dp", "cp")`, the
    batch split over `"dp"` too."""
    if dp == 1:
        return jax.make_mesh((cp,), (AXIS,), devices=jax.devices()[:cp])
    return jax.make_mesh((dp, cp), ("dp", AXIS), devices=jax.devices()[: dp * cp])


def _batch_spec(mesh) -> P:
    """`(batch, seq)` arrays: time over `"cp"`, the batch over `"dp"` if the mesh has it."""
    return P("dp" if "dp" in mesh.axis_names else None, AXIS)


def shard_batch(batch, mesh, layout: dcp.AbstractLayout = dcp.Contiguous()):
    """Put `(inputs, targets, mask)` on the mesh, time sharded over `"cp"` (in the layout's
    order first, e.g. zigzag order: the only reorder; every layer then works on these
    shards)."""
    if mesh is None:
        return tuple(jnp.asarray(x) for x in batch)
    batch = tuple(layout.to_layout(x, mesh.shape[AXIS], axis=1) for x in batch)
    sharding = NamedSharding(mesh, _batch_spec(mesh))
    return tuple(jax.device_put(x, sharding) for x in batch)


def make_train_step(cfg: Config, cp: int, optimizer, dp: int = 1) -> tuple[Callable, Mesh | None]:
    """A jitted `(model, opt_state, batch) -> (model, opt_state, loss)` and the mesh (`None`
    on one device: `cp == dp == 1`)."""
    mesh = make_mesh(cp, dp) if cp * dp > 1 else None

    @eqx.filter_jit
    def step(model, opt_state, inputs, targets, mask):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(
            model, inputs, targets, mask, cp=cp, mesh=mesh, cfg=cfg
        )
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    return step, mesh


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """AdamW after global-norm clipping, with a linear warmup to a constant learning rate."""
    schedule = optax.linear_schedule(0.0, cfg.learning_rate, cfg.warmup_steps)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, weight_decay=cfg.weight_decay),
    )


def train(cfg: Config, cp: int, *, dp: int = 1, progress: Callable | None = None) -> list[float]:
    """Train from `cfg.seed` at context-parallel degree `cp`, the batch split over `dp`
    data-parallel ranks; the per-step losses.

    `progress(step, loss)` is called after each step (e.g. a progress bar's update).
    """
    if cfg.batch_size % dp:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by dp={dp}.")
    pieces = cp if cfg.layout == "contiguous" else 2 * cp
    if cfg.seq_len % pieces:
        raise ValueError(f"seq_len {cfg.seq_len} must be divisible by {pieces} ({cfg.layout}).")
    model = make_model(cfg, jr.key(cfg.seed))
    optimizer = make_optimizer(cfg)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step, mesh = make_train_step(cfg, cp, optimizer, dp)
    if mesh is not None:
        # Replicated from the start, as every step returns them: one compilation, not two.
        model, opt_state = eqx.filter_shard((model, opt_state), NamedSharding(mesh, P()))
    losses = []
    data = batches(cfg)
    for i in range(cfg.steps):
        batch = shard_batch(next(data), mesh, context_parallel(cfg).layout)
        model, opt_state, loss = step(model, opt_state, *batch)
        losses.append(float(loss))
        if progress is not None:
            progress(i, losses[-1])
    return losses


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks (the batch)")
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--seq-len", type=int, default=Config.seq_len)
    parser.add_argument("--exchange", default=Config.exchange)
    parser.add_argument("--layout", default=Config.layout, choices=["contiguous", "zigzag"])
    parser.add_argument("--kv-schedule", default=Config.kv_schedule, choices=["allgather", "ring"])
    args = parser.parse_args()
    cfg = Config(
        steps=args.steps,
        seq_len=args.seq_len,
        exchange=args.exchange,
        layout=args.layout,
        kv_schedule=args.kv_schedule,
    )
    for i, loss in enumerate(train(cfg, args.cp, dp=args.dp)):
        print(f"step {i:3d}  loss {loss:.4f}")


if __name__ == "__main__":
    main()

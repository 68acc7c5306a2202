"""Train a tiny Qwen3.5 model on packed documents over several hosts, one process per host.

On one host (every local device; on a CPU, `--local-devices` simulated ones):

    python examples/multihost.py --local-devices 4 --layout zigzag

On two hosts, the same command on each, with its own `--process-id` (here two processes on
one machine, two CPU devices each; on a cluster JAX can find all three values itself:
`--auto`):

    python examples/multihost.py --local-devices 2 --layout zigzag \\
        --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 0 &
    python examples/multihost.py --local-devices 2 --layout zigzag \\
        --coordinator 127.0.0.1:1234 --num-processes 2 --process-id 1

The mesh is `("dp", "cp")`: the context axis inside a host (each sequence's shards travel
over the host's fast links, once per layer) and the data axis across hosts (one gradient
all-reduce per step). Every process packs the same documents (the same seed) and hands JAX
only the rows and the positions its own devices hold (`deltanet_cp.data.make_global_batch`;
under `zigzag` two pieces of each row per rank). It prints the loss of every step and a
checksum of the parameters, the same on every host and as one process on the same mesh shape
to float32 rounding.
"""

import argparse
import os


if __name__ == "__main__":  # before jax is imported: the simulated CPU devices, if asked for
    _early = argparse.ArgumentParser(add_help=False)
    _early.add_argument("--local-devices", type=int, default=None)
    if (_devices := _early.parse_known_args()[0].local_devices) is not None:
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_devices}"
        ).strip()

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import deltanet_cp as dcp
from deltanet_cp.data import causal_lm_loss, make_global_batch, pack_documents
from deltanet_cp.models import Qwen3_5Config, Qwen3_5ForCausalLM


CONFIG = Qwen3_5Config(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    layer_types=("linear_attention", "full_attention"),
)
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}
MAX_DOCUMENTS = 4  # per row: a fixed `cu_seqlens` width, so the step compiles once


def _arguments(argv=None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--coordinator",
        default=env("JAX_COORDINATOR_ADDRESS"),
        help="host:port of process 0's coordinator (default: $JAX_COORDINATOR_ADDRESS); "
        "none: one process",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=int(env("JAX_NUM_PROCESSES", "1")),
        help="processes (hosts) in all (default: $JAX_NUM_PROCESSES or 1)",
    )
    parser.add_argument(
        "--process-id",
        type=int,
        default=int(env("JAX_PROCESS_ID", "0")),
        help="this process's index, 0 to num-processes - 1 (default: $JAX_PROCESS_ID or 0)",
    )
    parser.add_argument(
        "--auto",
        action="store_true",
        help="let jax.distributed.initialize() find the three values (SLURM, Cloud TPU, ...)",
    )
    parser.add_argument(
        "--local-devices",
        type=int,
        default=None,
        help="on a CPU: the simulated devices of this process (XLA's device count flag)",
    )
    parser.add_argument(
        "--cp", type=int, default=None, help="the context axis's size (default: a host's devices)"
    )
    parser.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=None, help="rows per step (default: 2 dp)")
    parser.add_argument("--row-length", type=int, default=64, help="tokens per row")
    parser.add_argument("--save", default=None, help="process 0 writes the parameters here (.npz)")
    return parser.parse_args(argv)


def start(args: argparse.Namespace) -> None:
    """Join the other processes (`jax.distributed.initialize`); nothing for one process."""
    if not args.auto and args.num_processes == 1:
        return
    # On CPUs the collectives between processes need gloo; GPUs and TPUs ignore this.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.auto:
        jax.distributed.initialize()
    else:
        if args.coordinator is None:
            raise ValueError(
                "Several processes need a coordinator: pass --coordinator HOST:PORT (process "
                "0's address) or set JAX_COORDINATOR_ADDRESS."
            )
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )


def make_mesh(cp: int | None = None, devices=None) -> Mesh:
    """The `("dp", "cp")` mesh: each host's devices hold whole rows of it (the context axis
    inside a host), the hosts one after another along `"dp"` (the data axis across hosts)."""
    devices = jax.devices() if devices is None else list(devices)
    hosts = len({d.process_index for d in devices})
    local = len(devices) // hosts
    cp = local if cp is None else cp
    if local % cp:
        raise ValueError(
            f"--cp {cp} must divide a host's {local} devices: the context axis stays inside a host."
        )
    grid = mesh_utils.create_hybrid_device_mesh(
        (local // cp, cp), (hosts, 1), devices, process_is_granule=True
    )
    return Mesh(grid, ("dp", "cp"))


def documents(rng: np.random.Generator, tokens: int, longest: int) -> list[np.ndarray]:
    """Documents of 4 to `longest` tokens, `tokens` or a few more in all, each counting up
    from a random token by a random stride of 1 to 3 (modulo the vocabulary): learnable from
    the tokens before."""
    out = []
    while sum(d.size for d in out) < tokens:
        n, first, stride = (
            rng.integers(4, longest + 1),
            rng.integers(CONFIG.vocab_size),
            rng.integers(1, 4),
        )
        out.append(((first + stride * np.arange(n)) % CONFIG.vocab_size).astype(np.int32))
    return out


def batches(steps: int, rows: int, row_length: int, seed: int = 0):
    """`steps` packed batches of `rows` rows each: the same in every process (one seed)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        docs = documents(rng, 2 * rows * row_length, row_length // 2)
        packed = pack_documents(docs, row_length, max_documents=MAX_DOCUMENTS)
        yield type(packed)(*(a[:rows] for a in packed))


def make_step(static, mesh: Mesh, layout, optimizer):
    """The training step: the loss over every real target of the batch (rows over `"dp"`,
    positions over `"cp"` in `layout`), its gradient and an AdamW update; the parameters
    and optimizer state replicated."""
    context = dcp.ContextParallel("cp", layout=layout) if mesh.shape["cp"] > 1 else None

    def per_rank(params, tokens, labels, cu_seqlens):  # this rank's rows and positions
        model = eqx.combine(params, static)
        logits = jax.vmap(lambda t, cu: model(t, cp=context, cu_seqlens=cu))(tokens, cu_seqlens)
        return causal_lm_loss(logits, labels, axis_name=("dp", "cp"))[0]

    seq, rows = P("dp", "cp"), P("dp", None)
    loss_fn = jax.shard_map(per_rank, mesh=mesh, in_specs=(P(), seq, seq, rows), out_specs=P())

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(
            params, batch.tokens, batch.labels, batch.cu_seqlens
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def replicate(tree, mesh: Mesh):
    """Every array of `tree` (the same on every process) on every device of `mesh`."""
    everywhere = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(everywhere, np.asarray(x)), tree
    )


def local_copy(tree):
    """A replicated tree as NumPy arrays, read from this process's own devices."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def checksum(params) -> float:
    """A float64 sum of every parameter times its place (order matters): equal trees, equal
    sums."""
    total = 0.0
    for i, x in enumerate(jax.tree.leaves(params)):
        x = np.asarray(x, np.float64).ravel()
        total += float(np.sum(x * (1 + (np.arange(x.size) + i) % 7)))
    return total


def main(
    *,
    layout: str = "zigzag",
    steps: int = 5,
    cp: int | None = None,
    rows: int | None = None,
    row_length: int = 64,
    learning_rate: float = 3e-3,
    devices=None,
    verbose: bool = True,
) -> dict:
    """Train for `steps` steps; the losses, the parameters (NumPy, this process's copy) and
    their checksum."""
    say = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    mesh = make_mesh(cp, devices)
    dp, cp = mesh.shape["dp"], mesh.shape["cp"]
    batch_rows = 2 * dp if rows is None else rows
    cp_layout = LAYOUTS[layout]
    say(
        f"{jax.process_count()} process(es) x {jax.local_device_count()} devices: mesh "
        f"dp={dp} x cp={cp}, {layout} layout, {batch_rows} rows of {row_length} tokens per step"
    )

    model = Qwen3_5ForCausalLM(CONFIG, chunk_size=8, key=jr.key(0))  # the same everywhere
    params, static = eqx.partition(model, eqx.is_array)
    optimizer = optax.adamw(learning_rate)
    params = replicate(params, mesh)
    opt_state = replicate(optimizer.init(local_copy(params)), mesh)
    step = make_step(static, mesh, cp_layout, optimizer)

    losses = []
    for i, packed in enumerate(batches(steps, batch_rows, row_length)):
        # Each process gives JAX only the block of rows and positions its devices hold.
        batch = make_global_batch(packed, mesh, cp_layout, data_axis="dp", context_axis="cp")
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss.addressable_data(0)))
        say(f"step {i}  loss {losses[-1]:.6f}")
    local = local_copy(params)
    total = checksum(local)
    say(f"parameter checksum {total:.10e}")
    return {"losses": losses, "params": local, "checksum": total}


if __name__ == "__main__":
    ARGS = _arguments()
    start(ARGS)
    with jax.numpy_dtype_promotion("standard"):  # optax's step counts mix ints and floats
        result = main(
            layout=ARGS.layout,
            steps=ARGS.steps,
            cp=ARGS.cp,
            rows=ARGS.rows,
            row_length=ARGS.row_length,
        )
    if ARGS.save is not None and jax.process_index() == 0:
        leaves = jax.tree.leaves(result["params"])
        np.savez(ARGS.save, *leaves, losses=np.asarray(result["losses"]))
    if jax.process_count() > 1:
        jax.distributed.shutdown()

"""Shared pieces of the benchmark scripts: inputs, in-process pairing, the exchanges' cost
model, the machine, tables; and the set-up of programs compiled ahead of time on simulated
devices (the mesh, abstract placed arguments, parameter and optimizer specs, the compiled
program's time and `memory_analysis()`), small Qwen configs.

Nothing here imports jax or torch at module level, so every worker process can use it.
"""

import os
import statistics
import time
from collections.abc import Callable

import numpy as np


def gdn_inputs(rng: np.random.Generator, b: int, t: int, h: int, hv: int, d: int) -> list:
    """float32 `q, k, v, g, beta` for the gated delta rule, `K = V = d`: normal queries, keys
    and values, `g = -softplus(normal)`, `beta = sigmoid(normal)`, drawn from `rng` in that order.
    """
    q = rng.standard_normal((b, t, h, d), dtype=np.float32)
    k = rng.standard_normal((b, t, h, d), dtype=np.float32)
    v = rng.standard_normal((b, t, hv, d), dtype=np.float32)
    g = -np.log1p(np.exp(rng.standard_normal((b, t, hv)))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((b, t, hv))))).astype(np.float32)
    return [q, k, v, g, beta]


def paired_times(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Wall times of zero-argument `calls`, interleaved: round `i` runs every call once.

    For variants of one implementation in one process (e.g. two layouts of ours); peers
    are compared through `_harness.py`, one process each. The order rotates from round to
    round, so no call always follows the same neighbour. Each call must block until its
    result is ready.
    """
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for n in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            calls[n]()
            times[n].append(time.perf_counter() - start)
    return times


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of `numerator[i] / denominator[i]`."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def payload_bytes(
    exchange,
    cp: int,
    *,
    map_elements: int,
    state_elements: int,
    final_state: bool = False,
    layout=None,
    itemsize: int = 4,
) -> int:
    """Bytes the busiest rank receives in one exchange of maps, by the exchange's own cost
    model (`payload_elements`): every benchmark reads the cost model through here.

    `map_elements` are one rank's map, e.g. `B HV K (K + V)` for a dense `AffineMap`,
    `state_elements` one state, `B HV K V`; `itemsize` 4 for float32 maps.
    """
    elements = exchange.payload_elements(
        cp,
        map_elements=map_elements,
        state_elements=state_elements,
        final_state=final_state,
        layout=layout,
    )
    return itemsize * elements


def machine_line() -> str:
    """Cores visible to this process and the load average (how shared the machine is)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cores} cores, load average {load} (1, 5, 15 min)"


def small_qwen_sizes(vocab: int, hidden: int, layers: int, *, tied: bool) -> dict:
    """The sizes of a small Qwen3.5-family text config (3 Gated DeltaNet : 1 attention
    layers by the configs' default pattern): 4 attention heads of `hidden // 4` (2 key/value
    heads), 2 key and 4 value Gated DeltaNet heads of `hidden // 4`; the LM head `tied` to
    the embedding or not. The feed-forward sizes are the caller's."""
    quarter = hidden // 4
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=quarter,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=quarter,
        linear_value_head_dim=quarter,
        tie_word_embeddings=tied,
    )


def print_table(headers: list[str], rows: list[list], title: str | None = None) -> None:
    """Print a plain Markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    if title:
        print(f"\n{title}\n")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


# ---------------------------------------------------------------------------------------
# Programs compiled ahead of time on simulated devices (jax imported where used, so that a
# worker process without jax can still import this module)
# ---------------------------------------------------------------------------------------

MiB = 2**20
GiB = 2**30


def simulate_cpu_devices(count: int) -> None:
    """Ask XLA:CPU for `count` devices, before jax is imported; and keep FSDP's backward
    all-gathers apart from the forward's: XLA:CPU drops the optimization barriers that keep
    them apart before common-subexpression elimination, which then merges the backward's
    repeated all-gathers into the forward's (keeping the gathered weights alive); GPU and TPU
    keep the barriers, so measure what those compile
    (`--xla_disable_hlo_passes=cse_barrier_expander`)."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={count}"
        + " --xla_disable_hlo_passes=cse_barrier_expander"
    ).strip()


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A mesh of the first `prod(shape)` devices, every axis `Auto`."""
    import math

    import jax
    from jax.sharding import AxisType

    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, devices=devices, axis_types=(AxisType.Auto,) * len(names))


def is_struct(x) -> bool:
    """An abstract array (`jax.ShapeDtypeStruct`): a parameter of an abstract model."""
    import jax

    return isinstance(x, jax.ShapeDtypeStruct)


def is_spec(x) -> bool:
    from jax.sharding import PartitionSpec

    return isinstance(x, PartitionSpec)


def shard_bytes(tree, specs, mesh) -> int:
    """The bytes one device holds of `tree` placed by `specs`."""
    import math

    import jax

    total = 0
    for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(specs, is_leaf=is_spec)):
        split = 1
        for entry in s:
            names = () if entry is None else (entry,) if isinstance(entry, str) else entry
            split *= math.prod(mesh.shape[a] for a in names)
        total += math.prod(x.shape) // split * x.dtype.itemsize
    return total


def placed(tree, specs, mesh):
    """`tree`'s abstract arrays, each with its `NamedSharding` on `mesh` from `specs`."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=is_struct,
    )


def optimizer_specs(optimizer, state, specs):
    """The specs of an optax optimizer's `state`: each moment its parameter's, `P()` for the
    rest (the step count)."""
    import optax
    from jax.sharding import PartitionSpec as P

    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, s: s,
        state,
        specs,
        transform_non_params=lambda _: P(),
        is_leaf=is_spec,
    )


def fsdp_specs(params, mesh, *, note: str = "", **kw):
    """`deltanet_cp.nn.partition_specs(params, mesh, **kw)`, each warning (a parameter that
    stays whole) printed as `  ({note}{message})`."""
    import warnings

    from deltanet_cp import nn

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = nn.partition_specs(params, mesh, **kw)
    for w in caught:
        print(f"  ({note}{w.message})")
    return specs


class Compiled:
    """A program lowered and compiled ahead of time, timed, with its `memory_analysis()`
    figures in bytes: `arguments`, `outputs`, `aliased` (outputs that reuse donated
    arguments), `temporaries`, and `peak`, what the program can need at once (arguments +
    outputs - aliased + temporaries)."""

    def __init__(self, jitted, *args, standard_promotion: bool = False):
        """Lower `jitted` on `args` (abstract or real arrays) and compile it; with
        `standard_promotion`, under `jax.numpy_dtype_promotion("standard")` (optax's step
        counts mix ints and floats)."""
        import contextlib
        import time

        import jax

        promotion = (
            jax.numpy_dtype_promotion("standard")
            if standard_promotion
            else contextlib.nullcontext()
        )
        start = time.perf_counter()
        with promotion:
            lowered = jitted.lower(*args)
        lowered_at = time.perf_counter()
        self.compiled = lowered.compile()
        self.lower_seconds = lowered_at - start
        self.compile_seconds = time.perf_counter() - lowered_at
        mem = self.compiled.memory_analysis()
        assert mem is not None
        self.arguments = mem.argument_size_in_bytes
        self.outputs = mem.output_size_in_bytes
        self.aliased = mem.alias_size_in_bytes
        self.temporaries = mem.temp_size_in_bytes
        self.peak = self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def seconds(self) -> float:
        """Tracing, lowering and compiling."""
        return self.lower_seconds + self.compile_seconds

"""Scanned layers and rematerialisation of the Qwen3.5-family models: compile time against
depth, and each remat policy's temporaries and step time.

    python benchmarks/model_scan.py [--quick] [--model dense|next] [--depths 4,48]
        [--forms loop,scan] [--no-remat] [--seq 1024] [--repeats 5]

Two tables, on this machine's CPU (one device, float32, random parameters):

1. **Compile time against depth.** The training step (next-token loss and its gradient,
   `jax.value_and_grad`) of a tiny model (hidden 32) with `n` layers, 3 Gated DeltaNet : 1
   attention, lowered and compiled ahead of time on abstract arrays (nothing runs), as a
   Python loop over the layers (`scan_layers=False`) and scanned (`scan_layers=True`);
   seconds to trace and lower, to compile, and the compile time over the 4-layer one's.
   The persistent compilation cache is off, so every compile is a compile.
2. **Remat policies.** The same step of a small model (hidden 256, 8 layers, scanned) on a
   sequence of `--seq` tokens under each `remat` policy: `memory_analysis()`'s temporary
   bytes of the compiled step (what the backward keeps lives there) and the median step
   time over `--repeats` runs, the policies interleaved round by round.

`--model next` takes Qwen3-Next's layers instead (a sparse mixture-of-experts block in every
layer, 8 experts, top 2), `dense` (default) Qwen3.5's SwiGLU MLPs. The machine may be
shared: the load average is printed beside the tables.
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
from _common import (  # noqa: E402
    Compiled,
    is_struct,
    machine_line,
    paired_times,
    print_table,
    small_qwen_sizes,
)

from deltanet_cp.models import (  # noqa: E402
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from deltanet_cp.nn import load_balancing_loss  # noqa: E402


POLICIES = ("none", "layer", "feed_forward")


def config(model: str, layers: int, hidden: int) -> tuple[Any, Any]:
    """The model's class and a config of `layers` layers of width `hidden`."""
    sizes: dict[str, Any] = small_qwen_sizes(256, hidden, layers, tied=True)
    if model == "dense":
        return Qwen3_5ForCausalLM, Qwen3_5Config(intermediate_size=2 * hidden, **sizes)
    return Qwen3NextForCausalLM, Qwen3NextConfig(
        intermediate_size=2 * hidden,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden,
        shared_expert_intermediate_size=hidden,
        **sizes,
    )


def step_fn(static, remat: str):
    """The training step: the mean next-token loss (plus the load-balancing loss of a
    mixture-of-experts model) and its gradient."""

    def loss(params, tokens):
        model = eqx.combine(params, static)
        if model.config.is_sparse(0):
            logits, stats = model.logits_and_router_stats(tokens, remat=remat)
            aux = load_balancing_loss(stats)
        else:
            logits, aux = model(tokens, remat=remat), 0.0
        logp = jax.nn.log_softmax(logits[:-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[1:, None], -1)) + aux

    return jax.jit(jax.value_and_grad(loss))


def abstract_model(model: str, layers: int, hidden: int, scan: bool, chunk: int):
    cls, cfg = config(model, layers, hidden)
    return eqx.filter_eval_shape(cls, cfg, chunk_size=chunk, scan_layers=scan, key=jr.key(0))


def compile_times(model: str, layers: int, scan: bool, seq: int) -> tuple[float, float]:
    """(trace and lower, compile) seconds of the tiny model's training step."""
    params, static = eqx.partition(abstract_model(model, layers, 32, scan, 16), is_struct)
    tokens = jax.ShapeDtypeStruct((seq,), jnp.int32)
    c = Compiled(step_fn(static, "none"), params, tokens)
    return c.lower_seconds, c.compile_seconds


def remat_table(model: str, layers: int, hidden: int, seq: int, repeats: int) -> list[list]:
    cls, cfg = config(model, layers, hidden)
    real = cls(cfg, chunk_size=64, scan_layers=True, key=jr.key(0))
    params, static = eqx.partition(real, eqx.is_array)
    tokens = jr.randint(jr.key(1), (seq,), 0, cfg.vocab_size)
    compiled, temp = {}, {}
    for policy in POLICIES:
        program = Compiled(step_fn(static, policy), params, tokens)
        compiled[policy] = c = program.compiled
        temp[policy] = program.temporaries
        jax.block_until_ready(c(params, tokens))  # warm up
    times = paired_times(
        {p: (lambda c=c: jax.block_until_ready(c(params, tokens))) for p, c in compiled.items()},
        repeats,
    )
    rows = []
    for policy in POLICIES:
        t = statistics.median(times[policy])
        rows.append(
            [
                policy,
                f"{temp[policy] / 2**20:.1f}",
                f"{temp[policy] / temp['none']:.2f}",
                f"{1e3 * t:.1f}",
                f"{t / statistics.median(times['none']):.2f}",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 and 8 layers, short runs")
    parser.add_argument("--model", choices=("dense", "next"), default="dense")
    parser.add_argument("--depths", default=None, help="layer counts, e.g. 4,48")
    parser.add_argument("--seq", type=int, default=1024, help="tokens of the remat table")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--forms", default="loop,scan", help="loop, scan or both")
    parser.add_argument("--no-remat", action="store_true", help="the compile table only")
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    depths = [int(d) for d in (args.depths or ("4,8" if args.quick else "4,48")).split(",")]
    print(f"{jax.devices()[0].platform}, {machine_line()}; model: {args.model}")

    rows, base = [], {}
    forms = [f.strip() for f in args.forms.split(",")]
    for scan in [f == "scan" for f in ("loop", "scan") if f in forms]:
        for n in depths:
            lower, compile_s = compile_times(args.model, n, scan, 64)
            base.setdefault(scan, compile_s)
            rows.append(
                [
                    "scan" if scan else "loop",
                    n,
                    f"{lower:.1f}",
                    f"{compile_s:.1f}",
                    f"{compile_s / base[scan]:.2f}",
                ]
            )
            print(f"  {rows[-1]}", flush=True)
    print_table(
        ["layers as", "layers", "trace+lower s", "compile s", f"compile / {depths[0]} layers"],
        rows,
        title="Compile time of the training step (loss + grad), tiny model, 64 tokens",
    )

    if args.no_remat:
        return
    seq = 256 if args.quick else args.seq
    hidden, layers = (64, 4) if args.quick else (256, 8)
    print_table(
        ["remat", "temp MiB", "temp / none", "step ms", "time / none"],
        remat_table(args.model, layers, hidden, seq, 3 if args.quick else args.repeats),
        title=f"Remat policies: hidden {hidden}, {layers} layers scanned, {seq} tokens",
    )


if __name__ == "__main__":
    main()

"""Packed documents in causal softmax attention: what the document mask saves.

Eight documents packed into one row (`cu_seqlens`) against the same eight documents run
one at a time, and against the row without documents (causal over the whole row): the
blockwise attention kernel of `deltanet_cp.nn.CausalSelfAttention` on one device (the part
after the projections and RoPE: queries, keys and values in, output out), forward +
backward (the gradient of a weighted sum of the outputs w.r.t. q, k and v), float32.

- Matmul FLOPs, from the compiled program (`_seqdepth.matmul_flops`: every `dot`, a loop's
  body times its trips). The packed row's loops over tiles run a number of tiles known
  only at run time (the tiles the document mask leaves a visible pair in,
  `document_tiles`): it is read from the kernel's tile list and passed as their trips.
- Time: the median of paired rounds (every program once per round); "separate" is the
  sum of the eight documents' calls, one after the other.

The target: a packed row costs at most 1.3 x its documents run separately. On a small CPU,
pass smaller sizes (`--doc-len 1024`: eight 1K documents in 8K); `--quick` is a smoke test.

    python benchmarks/attention_packed.py                  # 8 x 4096 in 32768
    python benchmarks/attention_packed.py --doc-len 1024   # 8 x 1024 in 8192
    python benchmarks/attention_packed.py --untimed-causal # the causal row's FLOPs only
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from _seqdepth import matmul_flops

from deltanet_cp import Contiguous
from deltanet_cp.nn._flash import blockwise_attention, document_tiles, to_blocks
from deltanet_cp.nn._schedule import tile_loops


def _program(t: int, heads: int, dim: int, tile: int, packed: bool):
    """Jitted `(q, k, v, w, cu) -> (out, dq, dk, dv)` of the kernel on `t` tokens, with
    the documents of `cu` if `packed`."""
    pos = jnp.arange(t, dtype=jnp.int32)

    def loss(q, k, v, w, cu):
        out, _ = blockwise_attention(
            q,
            k,
            v,
            pos,
            cp=None,
            kv_schedule="allgather",
            tile_size=tile,
            cu_seqlens=cu if packed else None,
        )
        return jnp.sum(out * w), out

    def fn(q, k, v, w, cu):
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, w, cu)
        return out, *grads

    return jax.jit(fn)


def _tiles_run(t: int, tile: int, cu: np.ndarray) -> int:
    """The tiles the packed row's loops run (each loop, forward and backward)."""
    b = min(tile, t)
    ((schedule,),) = tile_loops(Contiguous().held(1), t // b, "allgather")
    pos = np.arange(t)
    starts = cu[np.searchsorted(cu, pos, side="right") - 1]
    _, _, count = document_tiles(
        schedule.at(0), to_blocks(jnp.asarray(starts), b), to_blocks(jnp.asarray(pos), b)
    )
    return int(count)


def _causal_tiles(t: int, tile: int) -> int:
    m = t // min(tile, t)
    return m * (m + 1) // 2


def _block(x):
    return jax.block_until_ready(x)


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--doc-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tile", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="8 x 256, 2 heads, tile 64")
    parser.add_argument(
        "--untimed-causal",
        action="store_true",
        help="compile the causal row for its FLOPs but do not time it (8x the packed row's work)",
    )
    args = parser.parse_args()
    if args.quick:
        args.doc_len, args.heads, args.tile, args.repeats = 256, 2, 64, 2
    n, length, h, d, tile = args.docs, args.doc_len, args.heads, args.dim, args.tile
    t = n * length
    rng = np.random.default_rng(0)

    def inputs(t):
        return [jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for _ in range(4)]

    cu = jnp.asarray(np.arange(n + 1) * length, jnp.int32)
    one_doc = jnp.asarray([0, length], jnp.int32)
    row, doc = inputs(t), [inputs(length) for _ in range(n)]
    programs = {
        "packed": (_program(t, h, d, tile, True), (*row, cu)),
        "separate": (_program(length, h, d, tile, False), None),
        "causal": (_program(t, h, d, tile, False), (*row, cu)),
    }
    trips = {
        "packed": _tiles_run(t, tile, np.asarray(cu)),
        "separate": n * _causal_tiles(length, tile),
        "causal": _causal_tiles(t, tile),
    }
    flops, calls = {}, {}
    for name, (fn, call_args) in programs.items():
        sample = call_args if call_args is not None else (*doc[0], one_doc)
        compiled = fn.lower(*sample).compile()
        unknown = trips["packed"] if name == "packed" else None
        flops[name] = matmul_flops(compiled, unknown) * (n if name == "separate" else 1)
        if call_args is not None:
            calls[name] = lambda c=compiled, a=call_args: _block(c(*a))
        else:
            calls[name] = lambda c=compiled: [_block(c(*x, one_doc)) for x in doc]
    if args.untimed_causal:
        del calls["causal"]
    for call in calls.values():  # warm up
        call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(args.repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    ms.setdefault("causal", float("nan"))

    print(
        f"attention fwd+bwd, one device, float32: {n} documents of {length} tokens "
        f"(row {t}), {h} heads x {d}, tile {tile}; {jax.devices()[0].device_kind}, "
        f"median of {args.repeats} paired rounds"
    )
    print(
        f"| {'run':<28} | {'tiles/loop':>10} | {'matmul GFLOP':>12} | {'ms':>9} | "
        f"{'FLOPs / separate':>16} | {'time / separate':>15} |"
    )
    print(f"|{'-' * 30}|{'-' * 12}|{'-' * 14}|{'-' * 11}|{'-' * 18}|{'-' * 17}|")
    labels = {
        "packed": f"packed ({n} in one row)",
        "separate": f"separate ({n} calls of {length})",
        "causal": f"causal {t}, no documents",
    }
    for name in ("packed", "separate", "causal"):
        print(
            f"| {labels[name]:<28} | {trips[name]:>10} | {flops[name] / 1e9:>12.2f} | "
            f"{ms[name]:>9.1f} | {flops[name] / flops['separate']:>16.3f} | "
            f"{ms[name] / ms['separate']:>15.3f} |"
        )
    ratio = ms["packed"] / ms["separate"]
    print(f"packed / separate time: {ratio:.3f} (target <= 1.3)")


if __name__ == "__main__":
    main()

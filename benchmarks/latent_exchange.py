"""Multi-head latent attention under context parallelism: the bytes each rank receives when
the other ranks' keys and values travel as their compressed latents, against full keys and
values.

Kimi-Linear-48B-A3B's attention sizes (transformers' `KimiLinearConfig` defaults, which are
the released `moonshotai/Kimi-Linear-48B-A3B-Instruct` values): hidden 2304, 32 heads,
`kv_lora_rank` 512, `qk_nope_head_dim` 128, `qk_rope_head_dim` 64, `v_head_dim` 128, no
`q_lora_rank`. One layer, compiled inside `shard_map` over `cp` simulated CPU devices
(zigzag layout), forward and training step (the gradient of `sum(out * w)` w.r.t. the
parameters and the input); nothing is executed.

- latent: [`deltanet_cp.nn.MultiHeadLatentAttention`][] as it is (the latents, 512 + 64
  numbers per token, are all-gathered or passed around the ring; each rank expands them).
- full K/V: the same layer with the keys and values expanded on their own rank and then
  exchanged (`blockwise_attention` on `num_heads * (qk_head_dim + v_head_dim)` = 10,240
  numbers per token), as a softmax-attention layer of these shapes would exchange them.
  Checked first at tiny sizes to compute the same output as the layer.

Bytes received per rank, from the compiled per-rank module
(`deltanet_cp.internal.received_bytes_per_rank`, a loop's collectives times its trips),
over the exchange's collectives (all-gather, collective-permute, reduce-scatter); the
all-reduce of the training step (the replicated parameters' gradients, the same for both,
and the loss) is printed apart. The sequence is short (`--seq`, default 1024 tokens in
all); every figure but that all-reduce grows linearly with it (the script checks this at
half the length), so the ratios hold at any length.

XLA:CPU compiles bfloat16 collectives as float32 ones (the lowered program gathers
bfloat16; the compiled one float32), so `--dtype bfloat16` prints float32's bytes here; on
an accelerator both columns halve and their ratio stays.

    python benchmarks/latent_exchange.py               # cp = 4 and 8, S = 1024, float32
    python benchmarks/latent_exchange.py --quick       # tiny sizes, a smoke test
"""

import argparse
import os


os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp.nn import MultiHeadLatentAttention  # noqa: E402
from deltanet_cp.nn._context import local_positions  # noqa: E402
from deltanet_cp.nn._flash import blockwise_attention  # noqa: E402


KIMI_48B = dict(
    hidden_size=2304,
    num_heads=32,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
TINY = dict(
    hidden_size=16,
    num_heads=2,
    kv_lora_rank=8,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
)
EXCHANGE = ("all-gather", "collective-permute", "reduce-scatter", "all-to-all")


def make_layer(sizes: dict, dtype, tile: int) -> MultiHeadLatentAttention:
    sizes = dict(sizes)
    hidden, heads = sizes.pop("hidden_size"), sizes.pop("num_heads")
    return MultiHeadLatentAttention(
        hidden, heads, **sizes, tile_size=tile, key=jr.key(0), dtype=dtype
    )


def full_kv_forward(layer: MultiHeadLatentAttention, x, cp, kv_schedule: str):
    """The layer's output with the keys and values expanded locally and then exchanged
    (written here from the layer's public parameters)."""
    assert layer.q_proj is not None, "the comparison is written for Kimi's q_proj"
    t, h = x.shape[0], layer.num_heads
    r, dn = layer.kv_lora_rank, layer.qk_nope_head_dim
    q = jax.vmap(layer.q_proj)(x).reshape(t, h, dn + layer.qk_rope_head_dim)
    ckv = jax.vmap(layer.kv_a_proj_with_mqa)(x)
    latent, k_rot = layer.kv_a_layernorm(ckv[:, :r]), ckv[:, r:]
    kv = jax.vmap(layer.kv_b_proj)(latent).reshape(t, h, -1)
    k_rot = jnp.broadcast_to(k_rot[:, None, :], (t, h, k_rot.shape[-1]))
    k = jnp.concatenate([kv[..., :dn], k_rot.astype(kv.dtype)], axis=-1)
    v = kv[..., dn:]
    precision = "bfloat16" if x.dtype == jnp.bfloat16 else "highest"
    out, _ = blockwise_attention(
        q,
        k,
        v,
        local_positions(cp, t),
        cp=cp,
        kv_schedule=kv_schedule,
        tile_size=layer.tile_size,
        precision=precision,
    )
    return jax.vmap(layer.o_proj)(out.reshape(t, -1).astype(layer.o_proj.weight.dtype))


def program(layer, cp: int, kv_schedule: str, variant: str, training: bool, t: int):
    """The jitted per-rank program and its (sharded) arguments."""
    mesh = jax.make_mesh((cp,), ("cp",), devices=jax.devices()[:cp])
    context = dcp.ContextParallel("cp", layout=dcp.Zigzag())
    params, static = eqx.partition(layer, eqx.is_array)
    dtype = layer.o_proj.weight.dtype

    def local(params, x, w):
        m = eqx.combine(params, static)
        if variant == "latent":
            y = m(x, cp=context, kv_schedule=kv_schedule)
        else:
            y = full_kv_forward(m, x, context, kv_schedule)
        return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * w), "cp"), y

    seq = P("cp")
    f = jax.shard_map(local, mesh=mesh, in_specs=(P(), seq, seq), out_specs=(P(), seq))
    if training:
        f = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)
    hidden = layer.o_proj.weight.shape[0]
    x = jr.normal(jr.key(1), (t, hidden), dtype)
    w = jnp.cos(jnp.arange(t * hidden, dtype=jnp.float32)).reshape(t, hidden)
    x = dcp.Zigzag().to_layout(x, cp, axis=0)
    w = dcp.Zigzag().to_layout(w, cp, axis=0)
    x, w = (jax.device_put(a, NamedSharding(mesh, seq)) for a in (x, w))
    return jax.jit(f), (params, x, w)


def received(layer, cp, kv_schedule, variant, training, t) -> tuple[int, int]:
    """`(exchange bytes, all-reduce bytes)` received per rank (the busiest rank)."""
    f, args = program(layer, cp, kv_schedule, variant, training, t)
    text = f.lower(*args).compile().as_text()
    assert text is not None
    exchange = dcp.internal.received_bytes_per_rank(text, kinds=EXCHANGE)
    reduce = dcp.internal.received_bytes_per_rank(text, kinds=("all-reduce",))
    return max(exchange.values(), default=0), max(reduce.values(), default=0)


def check_comparison(dtype) -> None:
    """The full-K/V program computes the layer's output (tiny sizes, cp = 4, both
    schedules)."""
    layer = make_layer(TINY, dtype, tile=4)
    for kv_schedule in ("allgather", "ring"):
        outs = []
        for variant in ("latent", "full"):
            f, args = program(layer, 4, kv_schedule, variant, False, 32)
            outs.append(np.asarray(f(*args)[1], np.float64))
        err = np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[1]))
        bound = 2e-2 if dtype == jnp.bfloat16 else 1e-5
        assert err <= bound, (kv_schedule, err)
        print(f"check: full-K/V program = layer ({kv_schedule}), max rel diff {err:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024, help="tokens in all (every rank)")
    parser.add_argument("--cp", default="4,8")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke test")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    sizes, t = (TINY, 64) if args.quick else (KIMI_48B, args.seq)
    tile = 4 if args.quick else 128
    layer = make_layer(sizes, dtype, tile)
    check_comparison(dtype)

    r, dr = sizes["kv_lora_rank"], sizes["qk_rope_head_dim"]
    h, dq = sizes["num_heads"], sizes["qk_nope_head_dim"] + dr
    per_token = {"latent": r + dr, "full": h * (dq + sizes["v_head_dim"])}
    print(
        f"\nKimi Linear attention {'(tiny) ' if args.quick else ''}sizes {sizes}, "
        f"{args.dtype}, S = {t} tokens, zigzag"
    )
    print(
        f"numbers per token exchanged: latent {per_token['latent']}, full K/V "
        f"{per_token['full']} ({per_token['full'] / per_token['latent']:.1f} x)\n"
    )
    head = (
        "| cp | schedule | pass | latent: KiB / rank | full K/V: KiB / rank | full / latent "
        "| latent / formula | all-reduce KiB (both) |"
    )
    print(head)
    print("|---|---|---|---|---|---|---|---|")
    itemsize = dtype.itemsize
    for cp in [int(c) for c in args.cp.split(",")]:
        for kv_schedule in ("allgather", "ring"):
            for training in (False, True):
                lat, reduce_lat = received(layer, cp, kv_schedule, "latent", training, t)
                full, reduce_full = received(layer, cp, kv_schedule, "full", training, t)
                formula = (cp - 1) * (t // cp) * per_token["latent"] * itemsize
                half, _ = received(layer, cp, kv_schedule, "latent", training, t // 2)
                assert 2 * half == lat, ("not linear in S", half, lat)
                what = "training step" if training else "forward"
                reduce = f"{reduce_lat / 1024:,.1f} / {reduce_full / 1024:,.1f}"
                print(
                    f"| {cp} | {kv_schedule} | {what} | {lat / 1024:,.1f} | {full / 1024:,.1f} "
                    f"| {full / lat:.1f} | {lat / formula:.2f} | {reduce} |"
                )
    print(
        "\nlatent / formula: the latent bytes over (cp - 1) / cp * S * (kv_lora_rank + "
        "qk_rope_head_dim) * itemsize, one pass of the latents. Every exchange figure is "
        "linear in S (checked at S / 2)."
    )


if __name__ == "__main__":
    main()

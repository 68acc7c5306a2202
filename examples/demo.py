"""`make demo`: train a tiny hybrid model (3 Gated DeltaNet : 1 softmax attention) with context
parallelism at cp = 1, 2, 4 from the same seed, on contiguous and on zigzag (load-balanced)
shards, and show that

1. the per-step losses agree across CP degrees and layouts, and with the batch split over
   two data-parallel ranks too (to float reduction-order noise);
2. what each rank receives per layer, read from compiled HLO, under both layouts: the Gated
   DeltaNet layers' payload does not grow with the sequence length, the attention layers' does;
3. the attention layers' work on the busiest rank against the causal ideal: about 2x under the
   contiguous layout, about 1x under zigzag.

Runs on CPU with simulated devices in a few minutes; writes examples/out/loss_curves.png.
"""

import os


# Four simulated CPU devices; must be set before jax is imported.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()

import dataclasses  # noqa: E402
import functools as ft  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp.nn import CausalSelfAttention, GatedDeltaNet  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_hybrid import AXIS, Config, make_model, train  # noqa: E402


OUT = Path(__file__).resolve().parent / "out"
# (cp, layout, dp) of each training run; cp = 1 is the single-device reference; the last
# splits the batch over two data-parallel ranks too (a ("dp", "cp") mesh of 2 x 2).
RUNS = (
    (1, "contiguous", 1),
    (2, "contiguous", 1),
    (4, "contiguous", 1),
    (2, "zigzag", 1),
    (4, "zigzag", 1),
    (2, "zigzag", 2),
)
PAYLOAD_SEQ_LENS = (256, 4096)
LAYOUTS = {"contiguous": dcp.Contiguous(), "zigzag": dcp.Zigzag()}


def _name(cp: int, layout: str, dp: int = 1) -> str:
    name = "cp=1" if cp == 1 else f"cp={cp} {layout[:3]}"
    return name if dp == 1 else f"dp={dp} {name}"


def train_all(cfg: Config) -> dict[str, list[float]]:
    from tqdm import tqdm

    losses = {}
    with tqdm(total=len(RUNS) * cfg.steps, unit="step", ncols=88) as bar:
        for cp, layout, dp in RUNS:
            name = _name(cp, layout, dp)
            bar.set_description(f"{name} (compiling)")

            def progress(i, loss, name=name):
                bar.set_description(f"{name} loss {loss:.3f}")
                bar.update()

            run_cfg = dataclasses.replace(cfg, layout=layout)
            losses[name] = train(run_cfg, cp, dp=dp, progress=progress)
    return losses


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.rjust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.rjust(w) for c, w in zip(row, widths)) + " |")


def print_loss_table(losses: dict[str, list[float]]) -> float:
    names = list(losses)
    steps = len(losses[names[0]])
    print(
        "\nPer-step training loss (same seed, same data; con = contiguous shards, zig = zigzag "
        "shards):\n"
    )
    rows, worst = [], 0.0
    for i in range(steps):
        row = [losses[n][i] for n in names]
        diff = max(row) - min(row)
        worst = max(worst, diff)
        rows.append([str(i), *(f"{x:.4f}" for x in row), f"{diff:.1e}"])
    _print_table(["step", *names, "max diff"], rows)
    return worst


def _layer_payload(
    layer, cfg: Config, cp: int, seq_len: int, parallel: dcp.ContextParallel, **kwargs
) -> dict[str, int]:
    """What the busiest rank receives in one forward pass of `layer` called with
    `cp=parallel`: bytes by collective kind (and `"total"`), from the compiled HLO. Nothing is
    executed."""
    mesh = jax.make_mesh((cp,), (AXIS,), devices=jax.devices()[:cp])
    seq = P(None, AXIS)
    f = jax.shard_map(
        lambda x: jax.vmap(ft.partial(layer, cp=parallel, **kwargs))(x),
        mesh=mesh,
        in_specs=seq,
        out_specs=seq,
    )
    x = jax.ShapeDtypeStruct(
        (cfg.batch_size, seq_len, cfg.hidden_size), jnp.float32, sharding=NamedSharding(mesh, seq)
    )
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert hlo is not None
    per_rank = dcp.internal.received_bytes_per_rank(hlo)
    busiest = max(per_rank, key=lambda r: per_rank[r])
    out = {"total": per_rank[busiest]}
    for c in dcp.internal.collectives(hlo):
        out[c.kind] = out.get(c.kind, 0) + c.received_bytes.get(busiest, 0)
    return out


PAYLOAD_COLUMNS = ("GDN, allgather", "GDN, ring", "attn, allgather", "attn, ring")


def payloads(
    cfg: Config, cp: int = 4, seq_lens: tuple[int, ...] = PAYLOAD_SEQ_LENS
) -> dict[tuple[int, str, str], int]:
    """Bytes the busiest rank receives per layer, by `(seq_len, layout, column)`: a Gated
    DeltaNet layer and an attention layer, each exchange, both layouts, from the HLO."""
    model = make_model(cfg, jr.key(cfg.seed))
    gdn = next(b.mixer for b in model.blocks if isinstance(b.mixer, GatedDeltaNet))
    attn = next(b.mixer for b in model.blocks if isinstance(b.mixer, CausalSelfAttention))
    out = {}
    for seq_len in seq_lens:
        for name, layout in LAYOUTS.items():
            for exchange in ("allgather", "ring"):
                parallel = dcp.ContextParallel(AXIS, layout=layout, exchange=exchange)
                p = _layer_payload(gdn, cfg, cp, seq_len, parallel)
                out[seq_len, name, f"GDN, {exchange}"] = p["total"]
            for kv in ("allgather", "ring"):
                parallel = dcp.ContextParallel(AXIS, layout=layout)
                p = _layer_payload(attn, cfg, cp, seq_len, parallel, kv_schedule=kv)
                # The ring's ppermute of (K, V) is in its loop over the cp - 1 steps:
                # `received_bytes_per_rank` counts it once per step.
                out[seq_len, name, f"attn, {kv}"] = p["total"]
    return out


def print_payloads(cfg: Config, cp: int = 4) -> None:
    model = make_model(cfg, jr.key(cfg.seed))
    gdn = next(b.mixer for b in model.blocks if isinstance(b.mixer, GatedDeltaNet))
    b, hv, dk, dv = cfg.batch_size, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim
    print(
        f"\nBytes each rank receives per layer, one forward pass (batch {b}, cp={cp}, float32),"
        " read from compiled HLO (the busiest rank):\n"
    )
    header = [
        "seq len",
        "layout",
        "GDN, allgather",
        "GDN, ring",
        "attn, allgather",
        "attn, ring",
    ]
    received = payloads(cfg, cp)
    rows = [
        [f"{seq_len:,}", name, *(f"{received[seq_len, name, c]:,} B" for c in PAYLOAD_COLUMNS)]
        for seq_len in PAYLOAD_SEQ_LENS
        for name in LAYOUTS
    ]
    _print_table(header, rows)
    m, st = b * hv * dk * (dk + dv), b * hv * dk * dv
    print(
        "\nGDN per layer: the conv halo (contiguous: one collective-permute of B*(W-1)*conv_dim;"
        " zigzag: two, one each way) plus the state exchange, independent of the sequence "
        "length. Its formula, `exchange.payload_elements(cp, map_elements, state_elements, "
        "layout=...)`, times 4 B:"
    )
    for name, layout in LAYOUTS.items():
        ag, ring = (
            4 * ex.payload_elements(cp, map_elements=m, state_elements=st, layout=layout)
            for ex in (dcp.AllGather(), dcp.Ring())
        )
        print(f"  {name:>10}: allgather {ag:,} B, ring {ring:,} B")
    print(
        "Attention per layer: the other ranks' keys and values, (cp-1)/cp * S * B * 2 * heads"
        " * head_dim * 4 B under either exchange and layout: linear in S."
    )


def print_attention_balance() -> None:
    print(
        "\nCausal attention work on the busiest rank / the ideal (total causal work / cp), "
        "from the global positions each layout gives each rank (`layout.position_table`); "
        "benchmarks/attention_balance.py measures the compiled kernels' tiles:\n"
    )
    rows = []
    for seq_len in (4096, 16384):
        for cp in (4, 8):
            row = [f"{seq_len:,}", str(cp)]
            for layout in LAYOUTS.values():
                positions = layout.position_table(seq_len // cp, cp)  # (cp, S / cp)
                busiest = (positions + 1).sum(axis=1).max()  # query t sees keys 0 .. t
                row.append(f"{busiest / (seq_len * (seq_len + 1) / 2 / cp):.3f}")
            rows.append(row)
    _print_table(["seq len", "cp", "contiguous", "zigzag"], rows)


def save_plot(losses: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = ["-", "--", ":", "-.", (0, (1, 3))]
    for i, (name, ls) in enumerate(losses.items()):
        ax.plot(ls, linestyle=styles[i % len(styles)], linewidth=3.0 if i == 0 else 1.5, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (recall positions)")
    ax.set_title("Hybrid GDN/attention LM: loss vs. CP degree and layout")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    cfg = Config()
    print(
        f"deltanet_cp {dcp.__version__} | jax {jax.__version__} | {jax.device_count()} "
        f"{jax.default_backend()} devices"
    )
    print(
        "Model: embedding, 4 blocks (3 Gated DeltaNet : 1 causal softmax attention), SwiGLU, "
        f"RMSNorm, LM head; {dataclasses.asdict(cfg)}"
    )
    start = time.perf_counter()
    losses = train_all(cfg)
    worst = print_loss_table(losses)
    print(f"\nLargest difference between runs at any step: {worst:.1e}")
    print_payloads(cfg)
    print_attention_balance()
    path = OUT / "loss_curves.png"
    save_plot(losses, path)
    print(f"\nSaved {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    print(f"Done in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()

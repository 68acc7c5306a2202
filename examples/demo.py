"""`make demo`: train a tiny hybrid model (3 Gated DeltaNet : 1 softmax attention) with context
parallelism at cp = 1, 2, 4 from the same seed, and show that

1. the per-step losses agree across CP degrees (to float reduction-order noise), and
2. what each rank receives per layer, read from compiled HLO: the Gated DeltaNet layers'
   payload does not grow with the sequence length, the attention layers' does.

Runs on CPU with simulated devices in a few minutes; writes examples/out/loss_curves.png.
"""

import os


# Four simulated CPU devices; must be set before jax is imported. (The second flag works
# around an XLA:CPU check failure, "b_rank < YNN_MAX_TENSOR_RANK", in the YNNPACK fusions.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=4 --xla_cpu_experimental_ynn_fusion_type="
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
from tqdm import tqdm  # noqa: E402

import deltanet_cp as dcp  # noqa: E402
from deltanet_cp.nn import CausalSelfAttention, GatedDeltaNet  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_hybrid import AXIS, Config, make_model, train  # noqa: E402


OUT = Path(__file__).resolve().parent / "out"
CP_DEGREES = (1, 2, 4)
PAYLOAD_SEQ_LENS = (256, 4096)


def train_all(cfg: Config) -> dict[int, list[float]]:
    losses = {}
    with tqdm(total=len(CP_DEGREES) * cfg.steps, unit="step", ncols=88) as bar:
        for cp in CP_DEGREES:
            bar.set_description(f"cp={cp} (compiling)")

            def progress(i, loss, cp=cp):
                bar.set_description(f"cp={cp} loss {loss:.3f}")
                bar.update()

            losses[cp] = train(cfg, cp, progress=progress)
    return losses


def print_loss_table(losses: dict[int, list[float]]) -> float:
    cps = list(losses)
    steps = len(losses[cps[0]])
    header = "| step | " + " | ".join(f"cp={cp}" for cp in cps) + " | max diff |"
    print("\nPer-step training loss (same seed, same data):\n")
    print(header)
    print("|" + "|".join("-" * (len(c) + 2) for c in header.strip("|").split("|")) + "|")
    worst = 0.0
    for i in range(steps):
        row = [losses[cp][i] for cp in cps]
        diff = max(row) - min(row)
        worst = max(worst, diff)
        print(
            f"| {i:4d} | "
            + " | ".join(f"{x:.4f}".rjust(len(f"cp={cp}")) for x, cp in zip(row, cps))
            + f" | {diff:8.1e} |"
        )
    return worst


def _layer_payload(layer, cfg: Config, cp: int, seq_len: int, **kwargs) -> dict[str, int]:
    """What the busiest rank receives in one forward pass of `layer`: bytes by collective kind
    (and `"total"`), from the compiled HLO. Nothing is executed."""
    mesh = jax.make_mesh((cp,), (AXIS,), devices=jax.devices()[:cp])
    seq = P(None, AXIS)
    f = jax.shard_map(
        lambda x: jax.vmap(ft.partial(layer, axis_name=AXIS, **kwargs))(x),
        mesh=mesh,
        in_specs=seq,
        out_specs=seq,
    )
    x = jax.ShapeDtypeStruct(
        (cfg.batch_size, seq_len, cfg.hidden_size), jnp.float32, sharding=NamedSharding(mesh, seq)
    )
    hlo = jax.jit(f).lower(x).compile().as_text()
    assert hlo is not None
    per_rank = dcp.received_bytes_per_rank(hlo)
    busiest = max(per_rank, key=lambda r: per_rank[r])
    out = {"total": per_rank[busiest]}
    for c in dcp.collectives(hlo):
        out[c.kind] = out.get(c.kind, 0) + c.received_bytes.get(busiest, 0)
    return out


def print_payloads(cfg: Config, cp: int = 4) -> None:
    model = make_model(cfg, jr.key(cfg.seed))
    gdn = next(b.mixer for b in model.blocks if isinstance(b.mixer, GatedDeltaNet))
    attn = next(b.mixer for b in model.blocks if isinstance(b.mixer, CausalSelfAttention))
    b, hv, dk, dv = cfg.batch_size, gdn.num_value_heads, gdn.key_head_dim, gdn.value_head_dim
    print(
        f"\nBytes each rank receives per layer, one forward pass (batch {b}, cp={cp}, float32),"
        " read from compiled HLO (the busiest rank):\n"
    )
    header = ["seq len", "GDN, allgather", "GDN, ring", "attention (K/V all-gather)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("-" * (len(h) + 2) for h in header) + "|")
    halo = None
    for seq_len in PAYLOAD_SEQ_LENS:
        row = [f"{seq_len:,}"]
        for exchange in ("allgather", "ring"):
            p = _layer_payload(gdn, cfg, cp, seq_len, exchange=exchange)
            halo = p.get("collective-permute", 0) if exchange == "allgather" else halo
            row.append(f"{p['total']:,} B")
        row.append(f"{_layer_payload(attn, cfg, cp, seq_len)['total']:,} B")
        print("| " + " | ".join(c.rjust(len(h)) for c, h in zip(row, header)) + " |")
    print(
        f"\nGDN per layer: the conv halo, one collective-permute of B*(W-1)*conv_dim*4 = "
        f"{halo:,} B, plus the state exchange: (cp-1)*B*HV*K*(K+V)*4 = "
        f"{(cp - 1) * b * hv * dk * (dk + dv) * 4:,} B (allgather) or one state B*HV*K*V*4 = "
        f"{b * hv * dk * dv * 4:,} B (ring). Independent of the sequence length.\n"
        "Attention per layer: (cp-1)/cp * S * B * 2 * heads * head_dim * 4 B, linear in S."
    )


def save_plot(losses: dict[int, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    styles = {1: ("-", 3.0), 2: ("--", 2.0), 4: (":", 2.0)}
    for cp, ls in losses.items():
        style, width = styles.get(cp, ("-", 1.0))
        ax.plot(ls, style, linewidth=width, label=f"cp={cp}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (recall positions)")
    ax.set_title("Hybrid GDN/attention LM: loss vs. context-parallel degree")
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
    print(f"\nLargest difference between CP degrees at any step: {worst:.1e}")
    print_payloads(cfg)
    path = OUT / "loss_curves.png"
    save_plot(losses, path)
    print(f"\nSaved {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    print(f"Done in {time.perf_counter() - start:.0f} s.")


if __name__ == "__main__":
    main()

"""Bytes each rank receives per layer: the gated delta rule's exchange vs softmax-attention CP.

Writes `docs/assets/payload_vs_seq.png` and prints the table behind it. No devices are needed:
the Gated DeltaNet side is each exchange's cost model (`_common.payload_bytes` of
`deltanet_cp.AllGather()`, `PPermute()`, `Ring()`: what the tests and `cp_cost.py` check
against the compiled HLO), the softmax side the formula of an all-gather of keys and
values.

    python benchmarks/payload_plot.py [--cp 8] [--batch 1] [--kv-bytes 2] [--out PATH]

Shapes are those of Qwen3.5-35B-A3B (`src/maxtext/configs/models/qwen3.5-35b-a3b.yml` in
MaxText; the Hugging Face `text_config` agrees):

- Gated DeltaNet layers: 32 value heads, K = V = 128; the maps travel in float32, as the
  library carries them.
- Full-attention layers: 2 key/value heads of size 256 (grouped-query attention); keys and
  values travel in bfloat16 by default (`--kv-bytes`). Softmax-attention CP by all-gather
  receives the keys and values of every other rank:
  `(cp - 1) * S/cp * B * n_kv_heads * head_dim * 2 * kv_bytes` bytes.

A Gated DeltaNet layer's causal convolution adds a halo of `(kernel - 1) * conv_dim` =
3 * 8192 bf16 elements (48 KiB) per rank, whatever the exchange; it is not plotted.
"""

import argparse
import pathlib

import matplotlib


matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402
from _common import payload_bytes, print_table  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

import deltanet_cp as dcp  # noqa: E402


# Qwen3.5-35B-A3B.
GDN_VALUE_HEADS, GDN_K, GDN_V = 32, 128, 128
ATTN_KV_HEADS, ATTN_HEAD_DIM = 2, 256
MAP_BYTES = 4  # float32 maps / states
EXCHANGES = {"allgather": dcp.AllGather(), "ppermute": dcp.PPermute(), "ring": dcp.Ring()}
COLORS = {"allgather": "tab:blue", "ppermute": "tab:orange", "ring": "tab:green"}
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent.parent / "docs/assets/payload_vs_seq.png"


def gdn_bytes(exchange: str, cp: int, batch: int) -> int:
    """Bytes one rank receives in the exchange of one Gated DeltaNet layer."""
    heads = batch * GDN_VALUE_HEADS
    return payload_bytes(
        EXCHANGES[exchange],
        cp,
        map_elements=heads * GDN_K * (GDN_K + GDN_V),  # one rank's dense map (M, U)
        state_elements=heads * GDN_K * GDN_V,
        itemsize=MAP_BYTES,
    )


def softmax_bytes(tokens_per_shard: float, cp: int, batch: int, kv_bytes: int) -> float:
    """Bytes one rank receives when softmax-attention CP all-gathers keys and values."""
    return (cp - 1) * tokens_per_shard * batch * ATTN_KV_HEADS * ATTN_HEAD_DIM * 2 * kv_bytes


def crossover(exchange: str, cp: int, batch: int, kv_bytes: int) -> float:
    """Tokens per shard above which the exchange receives fewer bytes than softmax CP."""
    return gdn_bytes(exchange, cp, batch) / softmax_bytes(1, cp, batch, kv_bytes)


def _mib(x: float) -> str:
    return f"{x / 2**20:,.2f}"


def _tokens_label(x: float, _=None) -> str:
    return f"{x / 1024:g}k" if x >= 1024 else f"{x:g}"


def _number_label(x: float, _=None) -> str:
    return f"{x:g}"


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--cp", type=int, default=8, help="context-parallel degree")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument("--kv-bytes", type=int, default=2, help="bytes per key/value element")
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    cp, batch, kv_bytes = args.cp, args.batch, args.kv_bytes
    if cp < 2:
        parser.error("--cp must be at least 2: with one rank nothing is exchanged.")

    tokens = [2**i for i in range(7, 18)]  # 128 ... 131072 tokens per shard
    rows = []
    for t in tokens:
        row = [f"{t:,}", _mib(softmax_bytes(t, cp, batch, kv_bytes))]
        row += [_mib(gdn_bytes(s, cp, batch)) for s in EXCHANGES]
        rows.append(row)
    print_table(
        ["tokens per shard", "softmax CP (MiB)"] + [f"GDN {s} (MiB)" for s in EXCHANGES],
        rows,
        title=(
            f"Bytes received per rank per layer, Qwen3.5-35B-A3B shapes, cp={cp}, B={batch}; "
            f"K/V in {kv_bytes}-byte elements, maps in float32"
        ),
    )
    cps = [2, 4, 8, 16, 32, 64]
    print_table(
        ["cp"] + [f"{s} crossover (tokens per shard)" for s in EXCHANGES],
        [[c] + [f"{crossover(s, c, batch, kv_bytes):,.0f}" for s in EXCHANGES] for c in cps],
        title="Tokens per shard above which the Gated DeltaNet exchange is the smaller one",
    )

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    ax.plot(
        tokens,
        [softmax_bytes(t, cp, batch, kv_bytes) / 2**20 for t in tokens],
        color="black",
        lw=2,
        label="softmax-attention CP (all-gather K, V)",
    )
    for s in EXCHANGES:
        y = gdn_bytes(s, cp, batch) / 2**20
        x_star = crossover(s, cp, batch, kv_bytes)
        ax.plot(tokens, [y] * len(tokens), color=COLORS[s], lw=2, label=f"Gated DeltaNet, {s}")
        ax.plot([x_star], [y], "o", color=COLORS[s], ms=7, zorder=3)
        ax.axvline(x_star, color=COLORS[s], ls=":", lw=1)
        ax.annotate(
            f"{x_star:,.0f}",
            (x_star, y),
            textcoords="offset points",
            xytext=(6, -14),
            color=COLORS[s],
            fontsize=9,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(_tokens_label))
    ax.yaxis.set_major_formatter(FuncFormatter(_number_label))
    ax.set_xlabel("tokens per shard (S / cp)")
    ax.set_ylabel("MiB received per rank per layer")
    ax.set_title(f"cp = {cp}: crossovers marked (tokens per shard)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=9)

    for s in EXCHANGES:
        ax2.plot(
            cps,
            [crossover(s, c, batch, kv_bytes) for c in cps],
            "o-",
            color=COLORS[s],
            lw=2,
            label=s,
        )
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log", base=2)
    ax2.set_xticks(cps, [str(c) for c in cps])
    ax2.yaxis.set_major_formatter(FuncFormatter(_tokens_label))
    ax2.set_xlabel("context-parallel degree cp")
    ax2.set_ylabel("crossover (tokens per shard)")
    ax2.set_title("Crossover vs cp: past it, the Gated DeltaNet exchange is smaller")
    ax2.grid(True, which="major", alpha=0.3)
    ax2.legend(fontsize=9)
    fig.suptitle(
        "Qwen3.5-35B-A3B shapes: GDN maps (32 heads, K = V = 128, float32) vs "
        f"softmax K/V (2 heads x 256, {8 * kv_bytes}-bit), B = {batch}",
        fontsize=11,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()

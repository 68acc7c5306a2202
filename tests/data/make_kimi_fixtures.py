"""Generate the Hugging Face `transformers` fixture of Kimi Linear's delta-attention layer
(`KimiLinearDeltaAttention`) for deltanet_cp's parity tests of `nn.KimiDeltaAttention`.

Like tests/data/make_hf_fixtures.py, this script is the only place that touches torch: the test
suite reads the files it writes (safetensors + json) with numpy/safetensors.

How to run (from the repository root, in the fixture virtualenv of make_hf_fixtures.py):

    .venv-bench/bin/python tests/data/make_kimi_fixtures.py

Deterministic (fixed seed, one torch thread, float32 on CPU, byte-identical files on re-runs)
and takes a second.

What it writes (under tests/data/):

  kimi_kda.json            the tiny config with transformers' field names (hidden_size,
                           linear_num_heads, linear_head_dim, linear_conv_kernel_dim,
                           rms_norm_eps, hidden_act), the class, the weight prefix, the cases,
                           versions and the cross-checks.
  kimi_kda.safetensors     the layer's state dict as transformers names it, under the prefix
                           `model.layers.0.self_attn.`. Weights only.
  kimi_kda_io.safetensors  batch 1:
                             x        (1, T, hidden)   the input, T = 70 (two chunks of 64)
                             out      (1, T, hidden)   transformers' output without a cache
                             g, beta  (1, T, H, K), (1, T, H)  the kernel's gates
                             core     (1, T, H, K)     the kernel's output (before o_norm)
                             decode_out      (1, P + S, hidden)  the first P = 25 tokens in one
                                             call through a `DynamicCache` (prefill), then
                                             S = 6 tokens one at a time through it (its
                                             single-token recurrent path)
                             decode_conv     (1, 3 K H, W)  the cache's conv state after them
                                             (transformers keeps the last W inputs)
                             decode_recurrent (1, H, K, K)  the cache's recurrent state

Every parameter is perturbed (the norm weight, `A_log`, `dt_bias` and the conv filters
included), so a wrong convention is seen. The decay rates `exp(A_log)` are spread
log-uniformly over [0.02, 2] and `dt_bias` is centred at -2, so some channels remember for tens
of tokens and the state carried between chunks matters; the json records how much the output
after the first chunk changes when that chunk is dropped.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers

# The environment guards and helpers of the other fixtures (this script's folder is on the path).
from make_hf_fixtures import _check_env, _rel, _versions
from safetensors.torch import save_file


OUT_DIR = Path(__file__).resolve().parent
NAME = "kimi_kda"
PREFIX = "model.layers.0.self_attn."
SEED = 20241038
CHUNK = 64
T = 70
PREFILL, STEPS = 25, 6

TINY: dict = dict(
    hidden_size=32,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)


class _Trace:
    """Count the calls of the modeling module's torch kernels (and record the chunked one's)."""

    NAMES = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")

    def __init__(self, module):
        self.module = module
        self.calls: dict[str, list] = {n: [] for n in self.NAMES}
        self._saved: dict = {}

    def __enter__(self):
        for name in self.NAMES:
            real = getattr(self.module, name)
            assert real.__module__ == self.module.__name__, real

            def traced(*args, _real=real, _name=name, **kwargs):
                out = _real(*args, **kwargs)
                self.calls[_name].append(dict(g=kwargs["g"], beta=kwargs["beta"], core=out[0]))
                return out

            self._saved[name] = real
            setattr(self.module, name, traced)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(self.module, name, fn)


def _randomize(layer, gen) -> None:
    h = layer.num_heads
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name == "forget_gate.A_log":  # (1, 1, H, 1)
                lo, hi = float(np.log(0.02)), float(np.log(2.0))
                edges = torch.linspace(lo, hi, h + 1, dtype=torch.float64)
                u = torch.rand(h, generator=gen, dtype=torch.float64)
                vals = edges[:-1] + u * (edges[1:] - edges[:-1])
                p.copy_(vals[torch.randperm(h, generator=gen)].to(p.dtype).reshape(p.shape))
            elif name == "forget_gate.dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) - 2.0)
            elif name == "o_norm.weight":
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name == "conv1d.weight":  # (C, 1, W)
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
            elif name in ("b_proj.weight", "forget_gate.f_b_proj.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            elif name.endswith(".weight") and p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")


def make_fixture(seed: int) -> dict:
    from transformers.cache_utils import DynamicCache
    from transformers.models.kimi_linear import (
        configuration_kimi_linear as cmod,
        modeling_kimi_linear as mmod,
    )

    gen = torch.Generator().manual_seed(seed)
    config = cmod.KimiLinearConfig(
        num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["dense"], **TINY
    )
    cls = mmod.KimiLinearDeltaAttention
    layer = cls(config, layer_idx=0).to(torch.float32).eval()
    _randomize(layer, gen)
    sd = {k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()}

    io: dict = {}
    checks: dict = {}
    with torch.no_grad():
        x = torch.randn(1, T, TINY["hidden_size"], generator=gen, dtype=torch.float32)
        with _Trace(mmod) as tr:
            out = layer(x)
        assert len(tr.calls["chunk_kimi_delta_attention"]) == 1, tr.calls
        assert not tr.calls["recurrent_kimi_delta_attention"], tr.calls
        c = tr.calls["chunk_kimi_delta_attention"][0]
        io.update(x=x, out=out, g=c["g"], beta=c["beta"], core=c["core"])
        # The chunked kernel against transformers' token-by-token one on the same inputs.
        with _Trace(mmod):
            tail = layer(x[:, CHUNK:])
        w = TINY["linear_conv_kernel_dim"]
        checks[f"rel_change_of_out[{CHUNK + w - 1}:]_when_first_chunk_dropped"] = _rel(
            tail[:, w - 1 :].numpy(), out[:, CHUNK + w - 1 :].numpy()
        )

        # Prefill, then one token at a time, through transformers' cache.
        cache = DynamicCache(config=config)
        with _Trace(mmod) as tr:
            outs = [layer(x[:, :PREFILL], cache=cache)]
            for t in range(PREFILL, PREFILL + STEPS):
                outs.append(layer(x[:, t : t + 1], cache=cache))
        assert len(tr.calls["chunk_kimi_delta_attention"]) == 1, tr.calls
        assert len(tr.calls["recurrent_kimi_delta_attention"]) == STEPS, tr.calls
        decode = torch.cat(outs, dim=1)
        io["decode_out"] = decode
        io["decode_conv"] = cache.get_conv_state(0)
        io["decode_recurrent"] = cache.get_recurrent_state(0)
        checks["decode_vs_full_forward_rel_err"] = _rel(
            decode.numpy(), out[:, : PREFILL + STEPS].numpy()
        )
        assert checks["decode_vs_full_forward_rel_err"] < 1e-4, checks

    io = {k: v.detach().to(torch.float32).contiguous() for k, v in io.items()}
    weights = {PREFIX + k: v for k, v in sd.items()}
    producer = "tests/data/make_kimi_fixtures.py"
    meta = {
        "producer": f"{producer} transformers={transformers.__version__} torch={torch.__version__}"
    }
    save_file(weights, str(OUT_DIR / f"{NAME}.safetensors"), metadata=meta)
    save_file(io, str(OUT_DIR / f"{NAME}_io.safetensors"), metadata=meta)
    desc = dict(
        TINY,
        model_type=config.model_type,
        hf_class=f"{cls.__module__}.{cls.__qualname__}",
        weight_prefix=PREFIX,
        weights_file=f"{NAME}.safetensors",
        io_file=f"{NAME}_io.safetensors",
        seq_len=T,
        prefill=PREFILL,
        steps=STEPS,
        batch=1,
        dtype="float32",
        seed=seed,
        state_dict={k: list(v.shape) for k, v in weights.items()},
        io={k: list(v.shape) for k, v in io.items()},
        kernel="chunk_kimi_delta_attention(chunk_size=64, use_qk_l2norm_in_kernel=True)",
        checks=checks,
        versions=_versions(),
    )
    (OUT_DIR / f"{NAME}.json").write_text(json.dumps(desc, indent=2) + "\n")
    return desc


def main() -> None:
    t0 = time.time()
    _check_env()
    torch.manual_seed(SEED)
    desc = make_fixture(SEED + 1)
    print(NAME, json.dumps(desc["checks"]))
    for p in sorted(OUT_DIR.glob(f"{NAME}*.safetensors")):
        size = p.stat().st_size
        assert size < 100_000, (p, size)
        print(f"{p.name}: {size} bytes")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()

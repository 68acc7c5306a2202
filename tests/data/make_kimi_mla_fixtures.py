"""Generate the Hugging Face `transformers` fixture of Kimi Linear's multi-head latent
attention (`KimiLinearAttention`) for deltanet_cp's parity tests of
`nn.MultiHeadLatentAttention`.

Like tests/data/make_hf_fixtures.py, this script is the only place that touches torch: the test
suite reads the files it writes (safetensors + json) with numpy/safetensors.

How to run (from the repository root, in a virtualenv with torch and transformers):

    /work/venv-hf/bin/python tests/data/make_kimi_mla_fixtures.py

The layer has no kernel of flash-linear-attention or causal-conv1d to route around; the
hub kernels of the `kernels` package replace a module's forward only after
`kernels.kernelize(model)`, which nothing here calls (the script checks that the RMSNorm's
forward is transformers' own).

Deterministic (fixed seed, one torch thread, float32 on CPU) and takes a second.

What it writes (under tests/data/), for two cases: `plain` (one `q_proj`, no biases: Kimi
Linear's released configuration) and `lora` (`q_lora_rank` set, `attention_bias=True`):

  kimi_mla.json             the tiny configs with transformers' field names, the class, the
                            weight prefixes, versions and the cross-checks.
  kimi_mla.safetensors      both layers' state dicts as transformers names them, under the
                            prefixes `model.layers.0.self_attn.` (plain) and
                            `model.layers.1.self_attn.` (lora). Weights only.
  kimi_mla_io.safetensors   batch 1, per case (`<case>.` in front of each name):
                              x           (1, T, hidden)  the input, T = 20
                              out         (1, T, hidden)  transformers' output (eager
                                          attention, causal mask)
                              decode_out  (1, P + S, hidden)  the first P = 9 tokens in one
                                          call through a `DynamicCache`, then S = 5 one at a
                                          time through it
                              decode_latent (1, 1, P + S, kv_lora_rank), decode_k_rot
                                          (1, 1, P + S, qk_rope_head_dim): the cache after them

Every parameter is perturbed (the RMSNorm weights and the biases included), so a wrong
convention is seen.
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
from make_hf_fixtures import _rel, _versions
from safetensors.torch import save_file


OUT_DIR = Path(__file__).resolve().parent
NAME = "kimi_mla"
SEED = 20261206
T = 20
PREFILL, STEPS = 9, 5

TINY: dict = dict(
    hidden_size=32,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)
CASES: dict = {
    "plain": dict(q_lora_rank=None, attention_bias=False),
    "lora": dict(q_lora_rank=12, attention_bias=True),
}


def _randomize(layer, gen) -> None:
    with torch.no_grad():
        for name, p in sorted(layer.named_parameters()):
            if name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".weight") and p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")


def _causal_mask(t: int, past: int = 0) -> torch.Tensor:
    """The additive mask of `t` queries after `past` cached tokens, `(1, 1, t, past + t)`."""
    q = torch.arange(past, past + t)[:, None]
    k = torch.arange(past + t)[None, :]
    mask = torch.zeros(t, past + t)
    mask[k > q] = torch.finfo(torch.float32).min
    return mask[None, None]


def make_case(case: str, index: int, gen) -> tuple[dict, dict, dict]:
    from transformers.cache_utils import DynamicCache
    from transformers.models.kimi_linear import (
        configuration_kimi_linear as cmod,
        modeling_kimi_linear as mmod,
    )

    config = cmod.KimiLinearConfig(
        num_hidden_layers=1,
        layer_types=["full_attention"],
        mlp_layer_types=["dense"],
        **TINY,
        **CASES[case],
    )
    config._attn_implementation = "eager"
    cls = mmod.KimiLinearAttention
    forward = mmod.KimiLinearRMSNorm.forward
    assert forward.__module__ == mmod.__name__ and forward.__qualname__.startswith(
        "KimiLinearRMSNorm"
    ), forward
    layer = cls(config, layer_idx=0).to(torch.float32).eval()
    _randomize(layer, gen)
    prefix = f"model.layers.{index}.self_attn."
    weights = {prefix + k: v.detach().clone().contiguous() for k, v in layer.state_dict().items()}

    io: dict = {}
    checks: dict = {}
    with torch.no_grad():
        x = torch.randn(1, T, TINY["hidden_size"], generator=gen, dtype=torch.float32)
        out, _ = layer(x, attention_mask=_causal_mask(T))
        io.update(x=x, out=out)
        cache = DynamicCache(config=config)
        outs = [layer(x[:, :PREFILL], attention_mask=_causal_mask(PREFILL), cache=cache)[0]]
        for t in range(PREFILL, PREFILL + STEPS):
            step = layer(x[:, t : t + 1], attention_mask=_causal_mask(1, t), cache=cache)[0]
            outs.append(step)
        decode = torch.cat(outs, dim=1)
        io["decode_out"] = decode
        io["decode_latent"] = cache.layers[0].keys
        io["decode_k_rot"] = cache.layers[0].values
        checks[f"{case}.decode_vs_full_forward_rel_err"] = _rel(
            decode.numpy(), out[:, : PREFILL + STEPS].numpy()
        )
        assert checks[f"{case}.decode_vs_full_forward_rel_err"] < 1e-5, checks
    io = {f"{case}.{k}": v.detach().to(torch.float32).contiguous() for k, v in io.items()}
    desc = dict(
        TINY,
        **CASES[case],
        weight_prefix=prefix,
        model_type=config.model_type,
        hf_class=f"{cls.__module__}.{cls.__qualname__}",
        state_dict={k: list(v.shape) for k, v in weights.items()},
    )
    return weights, io, dict(config=desc, checks=checks)


def main() -> None:
    t0 = time.time()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    weights: dict = {}
    io: dict = {}
    cases: dict = {}
    checks: dict = {}
    for index, case in enumerate(CASES):
        w, i, d = make_case(case, index, gen)
        weights |= w
        io |= i
        cases[case] = d["config"]
        checks |= d["checks"]
    producer = "tests/data/make_kimi_mla_fixtures.py"
    meta = {
        "producer": f"{producer} transformers={transformers.__version__} torch={torch.__version__}"
    }
    save_file(weights, str(OUT_DIR / f"{NAME}.safetensors"), metadata=meta)
    save_file(io, str(OUT_DIR / f"{NAME}_io.safetensors"), metadata=meta)
    desc = dict(
        cases=cases,
        weights_file=f"{NAME}.safetensors",
        io_file=f"{NAME}_io.safetensors",
        seq_len=T,
        prefill=PREFILL,
        steps=STEPS,
        batch=1,
        dtype="float32",
        seed=SEED,
        io={k: list(v.shape) for k, v in io.items()},
        attention="eager_attention_forward with an additive causal mask",
        checks=checks,
        versions=_versions(),
    )
    (OUT_DIR / f"{NAME}.json").write_text(json.dumps(desc, indent=2) + "\n")
    print(NAME, json.dumps(checks))
    for p in sorted(OUT_DIR.glob(f"{NAME}*.safetensors")):
        size = p.stat().st_size
        assert size < 100_000, (p, size)
        print(f"{p.name}: {size} bytes")
    print(f"done in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()

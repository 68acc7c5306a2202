"""Generate the Hugging Face fixtures for the whole-model tests of `deltanet_cp.models`.

Like `make_hf_fixtures.py`, this script is the only place that touches torch/transformers for
these fixtures; the tests read what it writes with numpy/safetensors.

How to run (from the repository root, in the benchmark virtualenv, which has torch 2.13 CPU
and transformers):

    .venv-bench/bin/python tests/data/make_qwen3_5_fixtures.py

Deterministic (fixed seeds, one torch thread, float32 on CPU) and takes a few seconds.

What it writes (under tests/data/):

  qwen3_5_lm/                   a tiny random `Qwen3_5ForCausalLM`, untied LM head, layer types
                                [linear, linear, linear, full], saved with `save_pretrained`
                                (config.json + one model.safetensors).
  qwen3_5_lm_tied/              another one, tied LM head, layer types [linear, full, linear,
                                full], saved over several files (`max_shard_size`): an index
                                (model.safetensors.index.json) and its shards.
  qwen3_5_lm_io.safetensors     for each model (suffix "" and "_tied"):
                                  tokens<s>        (T,) int32, fixed token ids
                                  logits<s>        (T, vocab) transformers' logits, one forward
                                  hidden<s>        (layers + 1, T, hidden) the hidden states
                                                   after the embedding and after every layer
                                                   (the last one after the final norm)
                                  decode_logits<s> (STEPS, vocab) the logits of tokens
                                                   T - STEPS .. T - 1, one at a time through
                                                   transformers' cache after a prefill of the
                                                   first T - STEPS tokens (its recurrent kernels)
  qwen3_5_lm.json               configs, versions and transformers' own consistency checks.

Every parameter is randomised (the RMSNorm offsets, A_log over a log-uniform spread of decay
rates, dt_bias, the conv filters, the attention's q/k norms): with transformers' init the norm
weights are zeros and a wrong (1 + w) convention would go unnoticed.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig


OUT_DIR = Path(__file__).resolve().parent
SEED = 20261201
EXPECTED_TORCH = "2.13.0"
T, STEPS = 48, 8

CONFIG: dict = dict(
    vocab_size=64,
    hidden_size=24,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
)
MODELS = {
    "": dict(
        tie_word_embeddings=False,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    ),
    "_tied": dict(
        tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention"] * 2,
    ),
}


def _check_env() -> None:
    if not torch.__version__.startswith(EXPECTED_TORCH):
        raise SystemExit(f"expected torch {EXPECTED_TORCH} (CPU), found {torch.__version__}")
    for pkg in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(pkg) is not None:
            raise SystemExit(
                f"`{pkg}` is importable: transformers would route around its pure-torch "
                "reference path. Use a virtualenv without it."
            )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def _randomize(model, gen) -> None:
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            short = name.rsplit(".", 2)
            if name.endswith("A_log"):
                lo, hi = float(np.log(0.02)), float(np.log(16.0))
                u = torch.rand(p.shape, generator=gen, dtype=torch.float64)
                p.copy_((lo + u * (hi - lo)).to(p.dtype))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: w, not 1 + w
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight"):  # the (1 + w) RMSNorms, transformers' init: zeros
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
            elif name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)} {short}")


def _build(suffix: str, gen) -> Qwen3_5ForCausalLM:
    config = Qwen3_5TextConfig(**CONFIG, **MODELS[suffix])
    config._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, gen)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def make(suffix: str, gen) -> tuple[dict, dict]:
    model = _build(suffix, gen)
    directory = OUT_DIR / f"qwen3_5_lm{suffix}"
    shutil.rmtree(directory, ignore_errors=True)
    if suffix == "_tied":
        model.save_pretrained(directory, max_shard_size="30KB")
        assert (directory / "model.safetensors.index.json").exists()
        assert len(list(directory.glob("model-*.safetensors"))) >= 3
    else:
        model.save_pretrained(directory)
        assert (directory / "model.safetensors").exists()
    (directory / "generation_config.json").unlink(missing_ok=True)

    tokens = torch.randint(0, CONFIG["vocab_size"], (1, T), generator=gen)
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, use_cache=False)
        logits = out.logits[0]
        hidden = torch.stack([h[0] for h in out.hidden_states])
        # The prefill, then one token at a time through transformers' cache.
        pre = model(tokens[:, : T - STEPS], use_cache=True)
        cache = pre.cache if hasattr(pre, "cache") else pre.past_key_values
        steps = []
        for t in range(T - STEPS, T):
            o = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
            cache = o.cache if hasattr(o, "cache") else o.past_key_values
            steps.append(o.logits[0, -1])
        decode = torch.stack(steps)
    io = {
        f"tokens{suffix}": tokens[0].to(torch.int32),
        f"logits{suffix}": logits,
        f"hidden{suffix}": hidden,
        f"decode_logits{suffix}": decode,
    }
    meta = {
        "layer_types": MODELS[suffix]["layer_types"],
        "tie_word_embeddings": MODELS[suffix]["tie_word_embeddings"],
        "files": sorted(p.name for p in directory.iterdir()),
        "decode_vs_forward_rel": _rel(decode, logits[T - STEPS :]),
        "logits_abs_max": float(logits.abs().max()),
    }
    return io, meta


def main() -> None:
    _check_env()
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    io: dict = {}
    meta: dict = {
        "config": CONFIG,
        "T": T,
        "decode_steps": STEPS,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
    }
    for suffix in MODELS:
        tensors, info = make(suffix, gen)
        io.update(tensors)
        meta["model" + suffix] = info
        print(suffix or "untied", info)
    save_file({k: v.contiguous() for k, v in io.items()}, OUT_DIR / "qwen3_5_lm_io.safetensors")
    (OUT_DIR / "qwen3_5_lm.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()

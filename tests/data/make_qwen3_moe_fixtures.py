"""Generate the Hugging Face fixtures of the mixture-of-experts tests (tests/test_qwen3_moe.py).

Like `make_qwen3_5_fixtures.py`, this script is the only place that touches torch/transformers for
these fixtures; the tests read what it writes with numpy/safetensors.

How to run (from the repository root, in a virtualenv with torch 2.13 CPU, transformers 5.x and
safetensors, and without flash-linear-attention or causal-conv1d):

    python tests/data/make_qwen3_moe_fixtures.py

Deterministic (fixed seeds, one torch thread, float32 on CPU) and takes a few seconds.

What it writes (under tests/data/):

  qwen3_next_moe/            a tiny random `Qwen3NextForCausalLM`: 8 experts, 2 per token
                             (`norm_topk_prob=False`: the top-k weights are not renormalised),
                             layer types [linear, full, linear, full], layer 1 in
                             `mlp_only_layers` (a dense SwiGLU MLP); saved with
                             `save_pretrained`, which writes Qwen3-Next's original layout: one
                             tensor per expert, `mlp.experts.{j}.{gate,up,down}_proj.weight`.
  qwen3_5_moe/               a tiny random `Qwen3_5MoeForCausalLM` (every layer sparse, top-k
                             weights renormalised), layer types [linear, linear, linear, full];
                             saved with `save_pretrained` over several files (an index and its
                             shards), with `save_original_format=False`: the experts fused,
                             `mlp.experts.gate_up_proj` (E, 2 I, H) and `mlp.experts.down_proj`
                             (E, H, I), the released checkpoints' layout. (transformers 5.25's
                             default, `save_original_format=True`, writes one tensor per expert
                             for both models; `qwen3_moe.json` lists the names of each.)
  qwen3_moe_io.safetensors   for each model (prefix "next_" and "moe_"):
                               tokens        (T,) int32, fixed token ids
                               logits        (T, vocab) transformers' logits, one forward
                               hidden        (layers + 1, T, hidden) the hidden states after
                                             the embedding and after every layer (the last
                                             after the final norm)
                               decode_logits (STEPS, vocab) the logits of tokens T - STEPS ..
                                             T - 1, one at a time through transformers' cache
                                             after a prefill of the others
                               generated     (NEW,) int32, greedy `generate` after the first
                                             T - STEPS tokens
                               aux_loss      () transformers' load-balancing loss of the
                                             forward (`output_router_logits=True`), without
                                             the coefficient
  qwen3_moe.json             configs, versions, which tensor names each `save_pretrained`
                             wrote (and what Qwen3-Next's `save_original_format=False` writes:
                             the fused layout), and transformers' own consistency checks.

Every parameter is randomised (the RMSNorm offsets, A_log over a spread of decay rates, dt_bias,
the conv filters, the q/k norms, the router, the experts, the shared expert and its gate): with
transformers' init the norm weights are zeros and a wrong (1 + w) convention would go unnoticed.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)


OUT_DIR = Path(__file__).resolve().parent
SEED = 20261203
EXPECTED_TORCH = "2.13.0"
T, STEPS, NEW = 12, 4, 5

COMMON: dict = dict(
    vocab_size=64,
    hidden_size=24,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    max_position_embeddings=128,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=12,
    router_aux_loss_coef=0.01,
    tie_word_embeddings=False,
)
MODELS: dict = {
    "next": (
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        dict(
            intermediate_size=20,
            layer_types=["linear_attention", "full_attention"] * 2,
            mlp_only_layers=[1],
            decoder_sparse_step=1,
            norm_topk_prob=False,
        ),
        "qwen3_next_moe",
    ),
    "moe": (
        Qwen3_5MoeTextConfig,
        Qwen3_5MoeForCausalLM,
        dict(layer_types=["linear_attention"] * 3 + ["full_attention"]),
        "qwen3_5_moe",
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
            elif name.endswith(("in_proj_b.weight", "in_proj_a.weight", "in_proj_ba.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):  # the router: logits of order one
                p.copy_(1.5 * torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
            elif p.ndim in (2, 3):  # projections, experts (E, out, in), the shared expert's gate
                p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[-1]))
            else:
                raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")


def _build(which: str, gen):
    config_cls, model_cls, extra, _ = MODELS[which]
    config = config_cls(**COMMON, **extra)
    config._attn_implementation = "eager"
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model, gen)
    return model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _names(directory: Path) -> list[str]:
    names = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            names.extend(f.keys())
    return sorted(names)


def _expert_names(names: list[str]) -> list[str]:
    return sorted({n for n in names if ".layers.0.mlp." in n or ".layers.2.mlp." in n})


def make(which: str, gen) -> tuple[dict, dict]:
    model = _build(which, gen)
    directory = OUT_DIR / MODELS[which][3]
    shutil.rmtree(directory, ignore_errors=True)
    if which == "moe":
        # The released checkpoints' layout (experts fused), which transformers 5.x writes
        # only with `save_original_format=False`.
        model.save_pretrained(directory, max_shard_size="40KB", save_original_format=False)
        assert (directory / "model.safetensors.index.json").exists()
    else:
        model.save_pretrained(directory)
        assert (directory / "model.safetensors").exists()
    (directory / "generation_config.json").unlink(missing_ok=True)
    names = _names(directory)
    meta: dict = {
        "model_class": type(model).__name__,
        "extra_config": MODELS[which][2],
        "files": sorted(p.name for p in directory.iterdir()),
        "mlp_tensor_names_layers_0_2": _expert_names(names),
    }
    # What the other setting of `save_original_format` writes.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, save_original_format=which == "moe")
        other = _names(Path(tmp))
    meta[f"save_original_format_{which == 'moe'}_mlp_names_layers_0_2"] = _expert_names(other)
    per_expert, fused = (names, other) if which == "next" else (other, names)
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in per_expert
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused

    tokens = torch.randint(0, COMMON["vocab_size"], (1, T), generator=gen)
    with torch.no_grad():
        out = model(tokens, output_hidden_states=True, use_cache=False, output_router_logits=True)
        logits = out.logits[0]
        hidden = torch.stack([h[0] for h in out.hidden_states])
        pre = model(tokens[:, : T - STEPS], use_cache=True)
        cache = pre.cache if hasattr(pre, "cache") else pre.past_key_values
        steps = []
        for t in range(T - STEPS, T):
            o = model(tokens[:, t : t + 1], cache=cache, use_cache=True)
            cache = o.cache if hasattr(o, "cache") else o.past_key_values
            steps.append(o.logits[0, -1])
        decode = torch.stack(steps)
        generated = model.generate(
            tokens[:, : T - STEPS], max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )[0, T - STEPS :]
    io = {
        f"{which}_tokens": tokens[0].to(torch.int32),
        f"{which}_logits": logits,
        f"{which}_hidden": hidden,
        f"{which}_decode_logits": decode,
        f"{which}_generated": generated.to(torch.int32),
        f"{which}_aux_loss": out.aux_loss.reshape(()).to(torch.float32),
    }
    meta.update(
        decode_vs_forward_rel=_rel(decode, logits[T - STEPS :]),
        logits_abs_max=float(logits.abs().max()),
        aux_loss=float(out.aux_loss),
    )
    return io, meta


def main() -> None:
    _check_env()
    gen = torch.Generator().manual_seed(SEED)
    torch.manual_seed(SEED)
    io: dict = {}
    meta: dict = {
        "config": COMMON,
        "T": T,
        "decode_steps": STEPS,
        "new_tokens": NEW,
        "versions": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
    }
    for which in MODELS:
        tensors, info = make(which, gen)
        io.update(tensors)
        meta[which] = info
        print(which, info)
    save_file({k: v.contiguous() for k, v in io.items()}, OUT_DIR / "qwen3_moe_io.safetensors")
    (OUT_DIR / "qwen3_moe.json").write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    main()

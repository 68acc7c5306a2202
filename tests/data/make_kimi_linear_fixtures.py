"""Generate the Hugging Face fixtures of the Kimi Linear model tests (tests/test_kimi_linear.py).

Like the other `make_*_fixtures.py`, this script is the only place that touches torch/transformers
for these fixtures; the tests read what it writes with numpy/safetensors.

How to run (from the repository root, in a virtualenv with torch 2.13 CPU, transformers 5.x and
safetensors):

    python tests/data/make_kimi_linear_fixtures.py

Deterministic (fixed seed, one torch thread, float32 on CPU) and takes a few seconds.

What it writes (under tests/data/), for each model NAME of `MODELS` (three Kimi Delta Attention
layers, or layer 1 a multi-head latent attention layer):

  NAME/                  a tiny random `KimiLinearForCausalLM` saved with `save_pretrained`
                         (transformers' default, the released checkpoints' layout: the KDA
                         layers' `q_conv1d` / `k_conv1d` / `v_conv1d`, `f_a_proj`, `A_log`, ...
                         beside the projections, the sparse layers under `block_sparse_moe.`
                         with one tensor per expert, `experts.{j}.w1` / `w2` / `w3`).
  NAME/io.safetensors    tokens (T,) int32, logits (T, vocab) of one forward, generated
                         (NEW,) int32 of greedy `generate` after the tokens (for a model of
                         KDA layers only, greedy full forwards without a cache: transformers'
                         `generate` needs an attention layer for its mask sizes).

The router's weight is drawn at a scale that spreads the sigmoid scores (transformers' init,
std 0.02, leaves them all near 0.5) and `e_score_correction_bias` is random, so the choice of
experts (scores plus bias) differs from their weights (scores alone) and the grouped top-k matters.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import KimiLinearConfig, KimiLinearForCausalLM


OUT = Path(__file__).resolve().parent
SEED = 20261206
T, NEW = 32, 16

BASE: dict = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_shared_experts=2,
    routed_scaling_factor=2.446,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    num_local_experts=8,
    norm_topk_prob=True,
    linear_head_dim=8,
    linear_num_heads=2,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    mlp_layer_types=["dense", "sparse", "sparse"],
)

MODELS: dict[str, dict] = {
    "kimi_linear": dict(layer_types=["linear_attention"] * 3),
    # Layer 1 multi-head latent attention (transformers' `KimiLinearAttention`, no rotary).
    "kimi_linear_mixed": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention"]
    ),
}


def _randomize(model, gen) -> None:
    """Perturb every parameter off its init: norms, router scale and bias, gates."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def make(name: str, extra: dict, gen) -> None:
    config = KimiLinearConfig(**BASE, **extra)
    torch.manual_seed(SEED)
    model = KimiLinearForCausalLM(config).eval()
    _randomize(model, gen)
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    model.save_pretrained(directory)
    tokens = torch.randint(3, config.vocab_size, (1, T), generator=gen)
    with torch.no_grad():
        logits = model(tokens, use_cache=False).logits[0]
        if "full_attention" in config.layer_types:
            out = model.generate(
                tokens, max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW, eos_token_id=None
            )
        else:
            # transformers' cache cannot generate with no attention layer (its mask sizes come
            # from one): greedy decoding by full forwards, no cache.
            out = tokens
            for _ in range(NEW):
                nxt = model(out, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                out = torch.cat([out, nxt], dim=1)
    generated = out[0, T:]
    save_file(
        {
            "tokens": tokens[0].to(torch.int32).contiguous(),
            "logits": logits.contiguous(),
            "generated": generated.to(torch.int32).contiguous(),
        },
        directory / "io.safetensors",
    )
    top2 = logits.topk(2, dim=-1).values
    print(name, "min top-2 logit margin", float((top2[:, 0] - top2[:, 1]).min()))
    print(name, "files", sorted(p.name for p in directory.iterdir()))
    print(name, "generated", generated.tolist())


def main() -> None:
    torch.set_num_threads(1)
    print("transformers", transformers.__version__, "torch", torch.__version__)
    gen = torch.Generator().manual_seed(SEED)
    for name, extra in MODELS.items():
        make(name, extra, gen)
    (OUT / "kimi_linear.json").write_text(
        json.dumps(
            {
                "base": BASE,
                "models": MODELS,
                "T": T,
                "new_tokens": NEW,
                "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()

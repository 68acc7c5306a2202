"""Qwen3.5 in bfloat16: ours against transformers in bfloat16 and in float32, on the test
fixtures' checkpoints.

    PYTHONPATH=. .venv-bench/bin/python benchmarks/qwen3_5_bf16.py

Needs torch and transformers (the benchmark virtualenv). For each shipped checkpoint
(`tests/data/qwen3_5_lm`, untied head, and `tests/data/qwen3_5_lm_tied`), loaded in float32
and cast to bfloat16 (transformers: `torch_dtype`; ours: `from_pretrained(dtype=...)`, whose
default precision policy is then `"bfloat16"`):

- the logits of the fixture's 48 tokens (one forward): the largest difference from
  transformers' float32 logits, over their largest magnitude, and how many of the 48
  positions have the same most likely next token;
- greedy decoding of `NEW` tokens after the first `PROMPT` tokens: how many leading tokens
  equal transformers' float32 continuation.

The yardstick is transformers' own bfloat16 against its float32: ours in bfloat16 should
agree with transformers' float32 about as far as that.
"""
# pyright: reportMissingImports=false

import json
import pathlib

import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

from deltanet_cp.models import Qwen3_5ForCausalLM


DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data"
CHECKPOINTS = {"untied": "", "tied": "_tied"}
PROMPT, NEW = 16, 32


def _hf(path: pathlib.Path, dtype):
    model = transformers.Qwen3_5ForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation="eager"
    )
    return model.eval()


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()


def _hf_greedy(model, prompt: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt[None], dtype=torch.long),
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].numpy()


def _prefix(a: np.ndarray, b: np.ndarray) -> int:
    same = np.asarray(a) == np.asarray(b)
    return int(len(same) if same.all() else np.argmin(same))


def main() -> None:
    torch.set_num_threads(1)
    io = load_file(DATA / "qwen3_5_lm_io.safetensors")
    rows = []
    for name, suffix in CHECKPOINTS.items():
        path = DATA / f"qwen3_5_lm{suffix}"
        tokens = np.asarray(io["tokens" + suffix])
        prompt = tokens[:PROMPT]
        ref = _hf_logits(_hf(path, torch.float32), tokens)
        ref_greedy = _hf_greedy(_hf(path, torch.float32), prompt)
        results = {}
        hf16 = _hf(path, torch.bfloat16)
        results["transformers bf16"] = (_hf_logits(hf16, tokens), _hf_greedy(hf16, prompt))
        for label, dtype in (("ours f32", None), ("ours bf16", jnp.bfloat16)):
            ours = Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype, chunk_size=8)
            logits = np.asarray(ours(jnp.asarray(tokens)).astype(jnp.float32))
            results[label] = (logits, np.asarray(ours.generate(jnp.asarray(prompt), NEW)))
        for label, (logits, greedy) in results.items():
            rows.append(
                {
                    "checkpoint": name,
                    "model": label,
                    "max |logit diff| / max |logit| vs transformers f32": float(
                        np.abs(logits - ref).max() / np.abs(ref).max()
                    ),
                    "argmax agreement (of 48)": int((logits.argmax(-1) == ref.argmax(-1)).sum()),
                    f"greedy prefix agreement (of {NEW})": _prefix(greedy, ref_greedy),
                    "greedy tokens equal (anywhere)": int((greedy == ref_greedy).sum()),
                }
            )
        bf = results["transformers bf16"]
        ob = results["ours bf16"]
        rows.append(
            {
                "checkpoint": name,
                "model": "ours bf16 vs transformers bf16",
                "argmax agreement (of 48)": int((ob[0].argmax(-1) == bf[0].argmax(-1)).sum()),
                f"greedy prefix agreement (of {NEW})": _prefix(ob[1], bf[1]),
            }
        )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = [f"{r[k]:.2e}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        print("| " + " | ".join(cells) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()

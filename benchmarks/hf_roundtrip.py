"""transformers reads what `save_pretrained` writes: a fine-tuned model's logits after the
round trip, ours against transformers', per model and expert layout.

For each test checkpoint (Qwen3.5, Qwen3-Next, Qwen3.5-MoE, Kimi Linear) the script loads it with
`from_pretrained`, changes every parameter as a fine-tuning step would (adds 1% Gaussian
noise of each tensor's scale, so what is written is not the file that was read), saves it
with `save_pretrained` (the MoE model in both expert layouts; one of them in shards of 40 KB)
and computes our float32 logits on fixed tokens. A second process, in an environment with
torch and transformers (`make bench`'s, or any with `torch` and `transformers` 5.x), loads
each folder with `AutoModelForCausalLM.from_pretrained` and computes transformers' float32
logits on the same tokens. The table gives the largest difference relative to the largest
logit, and whether our `from_pretrained` reads back the saved parameters bit for bit.

    python benchmarks/hf_roundtrip.py --hf-python .venv-bench/bin/python

Needs the `hf` extra (`safetensors`) in this environment for nothing: the library writes
and reads safetensors itself.
"""

# pyright: reportMissingImports=false

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
TOKENS = 40
# (name, fixture folder, save_pretrained's keywords)
CASES = [
    ("qwen3_5", "qwen3_5_lm", {}),
    ("qwen3_5_tied", "qwen3_5_lm_tied", {}),
    ("qwen3_next", "qwen3_next_moe", {}),
    ("qwen3_5_moe fused", "qwen3_5_moe", {"experts": "fused"}),
    (
        "qwen3_5_moe per_expert, 40KB shards",
        "qwen3_5_moe",
        {"experts": "per_expert", "max_shard_size": "40KB"},
    ),
    ("kimi_linear", "kimi_linear", {}),
    ("kimi_linear_mixed", "kimi_linear_mixed", {}),
    ("kimi_linear_mixed fused", "kimi_linear_mixed", {"experts": "fused"}),
]


def save(out: Path) -> None:
    """Our side: load, change, save, and our logits (and the read-back check)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import jax.random as jr
    import numpy as np

    from deltanet_cp import models

    classes = {
        "qwen3_5_lm": models.Qwen3_5ForCausalLM,
        "qwen3_5_lm_tied": models.Qwen3_5ForCausalLM,
        "qwen3_next_moe": models.Qwen3NextForCausalLM,
        "qwen3_5_moe": models.Qwen3_5MoeForCausalLM,
        "kimi_linear": models.KimiLinearForCausalLM,
        "kimi_linear_mixed": models.KimiLinearForCausalLM,
    }
    results = {}
    for name, folder, kwargs in CASES:
        cls = classes[folder]
        model = cls.from_pretrained(DATA / folder)
        params, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree.flatten(params)
        keys = jr.split(jr.key(0), len(leaves))
        leaves = [
            x + 0.01 * jnp.std(x) * jr.normal(k, x.shape, x.dtype) if x.size > 1 else x
            for x, k in zip(leaves, keys)
        ]
        model = eqx.combine(jax.tree.unflatten(treedef, leaves), static)
        path = out / name.replace(" ", "_").replace(",", "")
        model.save_pretrained(path, **kwargs)
        back = cls.from_pretrained(path)
        same = all(
            np.array_equal(a, b)
            for a, b in zip(
                jax.tree.leaves(eqx.filter(model, eqx.is_array)),
                jax.tree.leaves(eqx.filter(back, eqx.is_array)),
                strict=True,
            )
        )
        vocab = model.config.vocab_size
        tokens = np.random.default_rng(0).integers(0, vocab, TOKENS).astype(np.int32)
        logits = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, jnp.asarray(tokens)))
        np.save(path / "_ours_logits.npy", logits)
        np.save(path / "_tokens.npy", tokens)
        files = sorted(p.name for p in path.iterdir() if not p.name.startswith("_"))
        results[name] = {"path": str(path), "read_back_bit_identical": same, "files": files}
    (out / "ours.json").write_text(json.dumps(results))


def check(out: Path) -> None:
    """transformers' side: load each folder and compare its logits with ours."""
    import numpy as np
    import torch
    import transformers

    torch.manual_seed(0)
    torch.set_num_threads(1)
    ours = json.loads((out / "ours.json").read_text())
    rows = {}
    for name, info in ours.items():
        path = Path(info["path"])
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, output_loading_info=True
        )
        model.eval()
        problems = {k: sorted(v) for k, v in info.items() if v}
        tokens = torch.from_numpy(np.load(path / "_tokens.npy").astype(np.int64))[None]
        with torch.no_grad():
            # No cache: transformers' Kimi Linear cannot make one without attention layers.
            theirs = model(tokens, use_cache=False).logits[0].numpy()
        mine = np.load(path / "_ours_logits.npy")
        rows[name] = {
            "class": type(model).__name__,
            "max_diff_rel": float(np.max(np.abs(theirs - mine)) / np.max(np.abs(theirs))),
            "loading": "nothing missing, unexpected or mismatched"
            if not problems
            else str(problems),
        }
    rows["_versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
    (out / "theirs.json").write_text(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hf-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    parser.add_argument("--role", choices=["save", "check"], default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="the first two checkpoints only")
    args = parser.parse_args()
    if args.quick:
        del CASES[2:]
    if args.role == "save":
        return save(Path(args.out))
    if args.role == "check":
        return check(Path(args.out))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        me = [sys.executable, __file__, "--out", tmp]
        subprocess.run([*me, "--role", "save"], check=True, env=env, cwd=ROOT)
        hf = [args.hf_python, __file__, "--out", tmp, "--role", "check"]
        subprocess.run(hf, check=True, env=env, cwd=ROOT)
        ours = json.loads((out / "ours.json").read_text())
        theirs = json.loads((out / "theirs.json").read_text())
    versions = theirs.pop("_versions")
    v = versions
    print(f"transformers {v['transformers']}, torch {v['torch']}; {TOKENS} tokens, float32")
    print()
    print(
        "| checkpoint written by save_pretrained | transformers class "
        "| transformers' loading report | max abs(ours - transformers) / max abs(logit) "
        "| from_pretrained reads back | files |"
    )
    print("|---|---|---|---|---|---|")
    for name, info in ours.items():
        row = theirs[name]
        files = info["files"]
        shown = (
            ", ".join(files)
            if len(files) <= 3
            else f"{len(files)} files ({files[0]}, ..., {files[-1]})"
        )
        print(
            f"| {name} | {row['class']} | {row['loading']} | {row['max_diff_rel']:.1e} | "
            f"{'bit-identical' if info['read_back_bit_identical'] else 'DIFFERS'} | {shown} |"
        )


if __name__ == "__main__":
    main()

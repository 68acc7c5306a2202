"""Prefill and decoding time per token of `deltanet_cp.models.Qwen3_5ForCausalLM` on this CPU.

    python benchmarks/qwen3_5_decode.py [--quick]

Two random float32 models: `tiny` (the test fixture's sizes: hidden 24, 4 layers) and
`~100M` (hidden 768, 12 layers, 3 Gated DeltaNet : 1 attention, vocab 32000, tied head).
For each, one device, batch 1:

- `prefill`: `model.prefill(prompt)` (compiled), seconds per prompt token;
- `prefill+ckpt`: the same with `checkpoint_every=64` (the recurrent states every 64 tokens
  come out of the same pass);
- `decode_step`: one `model.decode_step` per token from a Python loop (the compiled step,
  dispatched once per token), after the prompt;
- `generate`: `model.generate`, whose decoding loop is one compiled `lax.scan`: the
  difference between generating `2 n` and `n` tokens from the prompt, over `n`.

Each figure is the median of `--repeats` timed runs after a compile-and-warm-up run; the
two prefills (and the two generations) alternate round by round. The machine may be shared:
the load average is printed beside the table.
"""

import argparse
import os
import statistics
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

from deltanet_cp.models import Qwen3_5Config, Qwen3_5ForCausalLM


CONFIGS = {
    "tiny": Qwen3_5Config(
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
    ),
    "~100M": Qwen3_5Config(
        vocab_size=32_000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=6,
        linear_num_value_heads=12,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        tie_word_embeddings=True,
    ),
}


def _median_times(fns, repeats: int) -> list[float]:
    """The median time of each function, the functions run in turn (paired rounds)."""
    for fn in fns:
        jax.block_until_ready(fn())  # compile and warm up
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def measure(name: str, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    config = CONFIGS[name]
    model = Qwen3_5ForCausalLM(config, key=jr.key(0))
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    prompt = jr.randint(jr.key(1), (prompt_len,), 0, config.vocab_size)
    capacity = prompt_len + new_tokens
    prefill = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=capacity))
    prefill_ckpt = eqx.filter_jit(lambda m, t: m.prefill(t, capacity=capacity, checkpoint_every=64))
    out: dict[str, float] = {"params": float(params)}
    plain, ckpt = _median_times(
        [lambda: prefill(model, prompt), lambda: prefill_ckpt(model, prompt)], repeats
    )
    out["prefill"], out["prefill+ckpt"] = plain / prompt_len, ckpt / prompt_len
    _, cache = prefill(model, prompt)

    def decode():
        c, token = cache, prompt[-1]
        for _ in range(new_tokens):
            logits, c = model.decode_step(token, c)
            token = jnp.argmax(logits)
        return token

    (step,) = _median_times([decode], repeats)
    out["decode_step"] = step / new_tokens
    generations = [lambda n=n: model.generate(prompt, n) for n in (new_tokens, 2 * new_tokens)]
    short, long = _median_times(generations, repeats)
    out["generate"] = (long - short) / new_tokens  # the prefill cancels
    return out


def main():
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cases = [("tiny", 128, 256)] + ([] if args.quick else [("~100M", 512, 32)])
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, load average {os.getloadavg()}")
    header = "| model | params | prompt | prefill ms/token | prefill+ckpt ms/token "
    header += "| decode_step ms/token | generate ms/token |"
    print(header)
    print("|---|---|---|---|---|---|---|")
    for name, prompt_len, new_tokens in cases:
        r = measure(name, prompt_len, new_tokens, args.repeats)
        print(
            f"| {name} | {r['params'] / 1e6:.2f}M | {prompt_len} | {1e3 * r['prefill']:.3f} "
            f"| {1e3 * r['prefill+ckpt']:.3f} | {1e3 * r['decode_step']:.3f} "
            f"| {1e3 * r['generate']:.3f} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

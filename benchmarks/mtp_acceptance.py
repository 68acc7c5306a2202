"""Self-speculative decoding with the multi-token-prediction head, on a toy.

    python benchmarks/mtp_acceptance.py [steps]

A random Qwen3.5 of the test fixture's sizes (hidden 24, vocab 64) with two layers (Gated
DeltaNet, attention) and an MTP head is trained for `steps` (default 400) Adam steps on
rows of a random 7-token pattern repeated, with the next-token loss plus the head's
(`logits_and_mtp`, `deltanet_cp.data.add_mtp_loss`, weight 1). Then, for four new
patterns, `generate` and `speculative_generate` decode 40 tokens greedily from 12 prompt
tokens: the script prints whether the tokens are the same, how many of the head's drafts
were kept, and the acceptance rate (kept drafts over two-token passes).
"""

import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

from deltanet_cp.data import add_mtp_loss, causal_lm_loss, IGNORE_INDEX, mtp_labels
from deltanet_cp.models import Qwen3_5Config, Qwen3_5ForCausalLM


steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
fields = json.loads(pathlib.Path("tests/data/qwen3_5_lm/config.json").read_text())
fields.update(
    num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], mtp_num_hidden_layers=1
)
model = Qwen3_5ForCausalLM(Qwen3_5Config.from_hf(fields), chunk_size=8, key=jr.key(0))
V, T, B, PERIOD = fields["vocab_size"], 32, 16, 7
rng = np.random.default_rng(0)


def batch():
    rows = []
    for _ in range(B):
        pattern = rng.integers(0, V, PERIOD)
        rows.append(np.resize(pattern, T))
    return jnp.asarray(np.stack(rows), jnp.int32)


def loss_fn(m, tokens):
    def one(t):
        labels = jnp.concatenate([t[1:], jnp.full((1,), IGNORE_INDEX, t.dtype)])
        logits, heads, _ = m.logits_and_mtp(t)
        return logits, heads, labels, mtp_labels(labels)

    logits, heads, labels, extra = jax.vmap(one)(tokens)
    loss, _ = causal_lm_loss(logits, labels)
    return add_mtp_loss(loss, heads, extra, 1.0)


opt = optax.adam(3e-3)
state = opt.init(eqx.filter(model, eqx.is_array))


@eqx.filter_jit
def step(m, state, tokens):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(m, tokens)
    updates, state = opt.update(grads, state, eqx.filter(m, eqx.is_array))
    return eqx.apply_updates(m, updates), state, loss


t0 = time.time()
for i in range(steps):
    model, state, loss = step(model, state, batch())
    if i % 50 == 0 or i == steps - 1:
        print(f"step {i}: loss (LM + MTP) {float(loss):.4f}", flush=True)
print(f"trained {steps} steps in {time.time() - t0:.1f} s")
total_acc = total_steps = 0
for k in range(4):
    prompt = jnp.asarray(np.resize(rng.integers(0, V, PERIOD), 12), jnp.int32)
    want = model.generate(prompt, 40)
    got, accepted, n = model.speculative_generate(prompt, 40)
    same = bool(np.array_equal(np.asarray(got), np.asarray(want)))
    total_acc, total_steps = total_acc + int(accepted), total_steps + int(n)
    print(f"prompt {k}: identical to generate: {same}; accepted {int(accepted)}/{int(n)} drafts")
print(
    f"acceptance rate {total_acc / total_steps:.3f}; {total_steps} model passes of two tokens "
    f"for {4 * 40} tokens (generate: {4 * 40} passes of one)"
)

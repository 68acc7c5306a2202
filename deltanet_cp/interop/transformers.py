"""transformers' torch kernels: code written against them ports by changing an import.

```python
# from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from deltanet_cp.interop.transformers import chunk_kimi_delta_attention

o, final_state = chunk_kimi_delta_attention(
    q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
    use_qk_l2norm_in_kernel=True,
)
```

Each function has transformers' name, argument names and positional order (`query, key,
value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel`),
takes JAX arrays in its `(B, T, H, ...)` layout, and returns what it returns: `(o,
final_state)` with `o` in `query`'s dtype and `None` for the state unless
`output_final_state=True`. Kimi Linear's functions are also exported under the names of
newer transformers releases, `torch_chunk_kda` and `torch_recurrent_kda`.
"""

from ._transformers import (
    chunk_kimi_delta_attention as chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention as recurrent_kimi_delta_attention,
    torch_chunk_gated_delta_rule as torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule as torch_recurrent_gated_delta_rule,
)


# Kimi Linear's names in newer transformers releases.
torch_chunk_kda = chunk_kimi_delta_attention
torch_recurrent_kda = recurrent_kimi_delta_attention

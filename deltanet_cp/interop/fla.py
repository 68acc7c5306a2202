"""flash-linear-attention's call shapes: code written against `fla.ops` ports by changing an import.

```python
# from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from deltanet_cp.interop.fla import chunk_gated_delta_rule

o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, scale, h0, True)
```

Each function has FLA's name, argument names and positional order, takes JAX arrays in FLA's
`(B, T, H, ...)` layout, and returns what FLA returns: `(o, final_state)`, with `None` for
the state unless `output_final_state=True` (the preconditioned rules,
`chunk_precond_gated_delta_rule` and `chunk_precond_kda` with their fused recurrent twins,
return `(o, final_state, final_A_state)`, as FLA's). It converts its arguments and runs the
recurrence of the deltanet_cp function named in its docstring; `chunk_gdn` and
`fused_recurrent_gdn` are FLA's aliases of `chunk_gated_delta_rule` and
`fused_recurrent_gated_delta_rule`, and `chunk_rwkv7` / `fused_recurrent_rwkv7` are RWKV-7's
call shape `(r, w, k, v, a, b)` of the generalized delta rule (`q = r`, `gk = w`).

Differences from FLA, the same for every function:

- `q` and `k` may have fewer heads than `v`: `v` is `(B, T, HV, V)` with `HV` a multiple of
    `H`, and value head `j` reads key head `j // (HV // H)` (for the generalized delta rule
    and RWKV-7, `a` and `b` have `H` heads too, the log decays `HV`).
- Any sequence length and any `chunk_size` work; `cu_seqlens` may be a list or an int array.
- `o` is in `v`'s dtype (FLA's kernels take `q`, `k`, `v` in one dtype, so the same there);
    the final state is float32 (float64 for float64 inputs).
- Context parallelism is deltanet_cp's own: every function takes
    `cp=deltanet_cp.ContextParallel(axis_name, ...)` (inside `jax.shard_map`, or with
    `mesh=` on global arrays) where FLA takes `cp_context`.
- FLA options without a counterpart here (in-kernel gates and sigmoids, `cp_context`,
    `reverse`, `gv`, ...) raise a `ValueError` that names them and says what to do instead,
    unless passed at their defaults. Options that only steer FLA's kernels
    (`cu_seqlens_cpu`, `chunk_indices`, `disable_recompute`) are accepted and unused.
"""

from ._fla_delta import (
    chunk_delta_rule as chunk_delta_rule,
    chunk_gated_delta_product as chunk_gated_delta_product,
    chunk_gated_delta_rule as chunk_gated_delta_rule,
    fused_recurrent_delta_rule as fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule as fused_recurrent_gated_delta_rule,
)
from ._fla_dplr import (
    chunk_dplr_delta_rule as chunk_dplr_delta_rule,
    chunk_rwkv7 as chunk_rwkv7,
    fused_recurrent_dplr_delta_rule as fused_recurrent_dplr_delta_rule,
    fused_recurrent_rwkv7 as fused_recurrent_rwkv7,
)
from ._fla_gla import (
    chunk_gla as chunk_gla,
    chunk_simple_gla as chunk_simple_gla,
    fused_recurrent_gla as fused_recurrent_gla,
    fused_recurrent_simple_gla as fused_recurrent_simple_gla,
)
from ._fla_kda import (
    chunk_gdn2 as chunk_gdn2,
    chunk_kda as chunk_kda,
    fused_recurrent_gdn2 as fused_recurrent_gdn2,
    fused_recurrent_kda as fused_recurrent_kda,
)
from ._fla_momentum import (
    chunk_momentum_delta_rule as chunk_momentum_delta_rule,
    fused_recurrent_momentum_delta_rule as fused_recurrent_momentum_delta_rule,
)
from ._fla_precond import (
    chunk_precond_gated_delta_rule as chunk_precond_gated_delta_rule,
    chunk_precond_kda as chunk_precond_kda,
    fused_recurrent_precond_gated_delta_rule as fused_recurrent_precond_gated_delta_rule,
    fused_recurrent_precond_kda as fused_recurrent_precond_kda,
)


# FLA's short names.
chunk_gdn = chunk_gated_delta_rule
fused_recurrent_gdn = fused_recurrent_gated_delta_rule

"""Kimi Delta Attention (KDA, Kimi Linear): the delta rule with a decay per key channel.

One token, per value head, with `g_t` a log decay per key channel:

    h <- diag(exp(g_t)) h                       (row i of h scaled by exp(g_t[i]))
    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (diag(gamma) - k~^T w) h + k~^T u`
with `gamma = exp(G_C)` a vector over the key channels. transformers' and
flash-linear-attention's call shapes are in `deltanet_cp.interop`.
"""

from typing import ClassVar

import equinox as eqx

from .._custom_types import CuSeqlens, GateTensor, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


class KimiDeltaRule(AbstractDeltaRule):
    """Kimi Delta Attention: a decay per token, value head and key channel, then a delta
    update.

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g` of
    shape `(B, T, HV, K)`, handed to [`deltanet_cp.run`][] beside it. Decays between
    tokens of a chunk are formed exactly for any gates, however negative (a blocked
    segment sum, no difference of cumulative sums).

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale, a Python float (a traced one is refused); `K ** -0.5` if
        `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `precision`: how the large products multiply: `"highest"` (float32 operands at
        `Precision.HIGHEST`), `"bfloat16"` (bfloat16 operands, float32 accumulation),
        `"default"` (`jax.default_matmul_precision`), or `None`: `"bfloat16"` for
        bfloat16 inputs, `"highest"` otherwise. The state, the decays and the chunk maps
        stay float32 under every policy.
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True, converter=as_l2norm_flag)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)
    gate: ClassVar[GateKind] = "key"
    householder: ClassVar[bool] = False


def chunk_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, States]:
    r"""Kimi Delta Attention in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow \mathrm{diag}(e^{g_t}) h$, then
    $h \leftarrow h + k_t (\beta_t (v_t - h^\top k_t))^\top$, $o_t = h^\top (s\, q_t)$.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `beta`: step sizes in $[0, 1]$ ($[0, 2]$ for negative eigenvalues), shape
        `(B, T, HV)`.
    - `scale`, `initial_state`, `use_qk_l2norm`, `cu_seqlens`, `chunk_size`, `cp`,
        `precision`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    """
    return run(
        KimiDeltaRule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, g, beta),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )


def recurrent_kda(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""Kimi Delta Attention token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_kda`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        KimiDeltaRule(
            chunk_size=1,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, g, beta),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
    )

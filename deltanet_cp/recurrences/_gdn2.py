"""Gated DeltaNet-2 (GDN-2): the delta rule with an erase gate per key channel and a write
gate per value channel, and a decay per key channel.

One token, per value head, with `g_t` a log decay per key channel, `b_t` the erase gate (one
per key channel) and `w_t` the write gate (one per value channel):

    h <- diag(exp(g_t)) h
    h <- h + k_t (w_t * v_t - h^T (b_t * k_t))^T
    o_t = h^T (scale q_t)

that is `S_t = (I - k_t (b_t * k_t)^T) diag(exp(g_t)) S_{t-1} + k_t (w_t * v_t)^T`, the
convention of flash-linear-attention's `fla.ops.gdn2`; `b_t = w_t = beta_t` is Kimi Delta
Attention. One chunk is an affine map of the incoming state, `h -> (diag(gamma) - k~^T w) h +
k~^T u`, with the WY factors `w = T (b * exp(G) * k)`, `u = T (w_gate * v)`.
"""

from typing import ClassVar

import equinox as eqx

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


class GatedDeltaNet2Rule(AbstractDeltaRule):
    """Gated DeltaNet-2: a decay per key channel, then a delta update that erases along
    `b * k` and writes `w * v`.

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g` and
    the erase gate `beta` of shape `(B, T, HV, K)` and the write gate `write` of shape
    `(B, T, HV, V)`, handed to [`deltanet_cp.run`][] beside it. Decays between tokens of a
    chunk are formed exactly for any gates, as for Kimi Delta Attention.

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale; `K ** -0.5` if `None`.
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
    channel_gates: ClassVar[bool] = True


def chunk_gdn2(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
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
    r"""Gated DeltaNet-2 in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow \mathrm{diag}(e^{g_t}) h$, then
    $h \leftarrow h + k_t (w_t \odot v_t - h^\top (b_t \odot k_t))^\top$,
    $o_t = h^\top (s\, q_t)$: $S_t = (I - k_t (b_t \odot k_t)^\top) \mathrm{diag}(e^{g_t})
    S_{t-1} + k_t (w_t \odot v_t)^\top$. With $b_t = w_t = \beta_t$ it is
    [`deltanet_cp.chunk_kda`][]. flash-linear-attention's
    `fla.ops.gdn2.chunk_gdn2` in name, argument order and result.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `b`: the erase gate, one per key channel, in $[0, 2]$, `(B, T, HV, K)`.
    - `w`: the write gate, one per value channel (typically in $[0, 1]$), `(B, T, HV, V)`.
    - `scale`, `initial_state`, `use_qk_l2norm`, `cu_seqlens`, `chunk_size`, `cp`,
        `precision`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    """
    return run(
        GatedDeltaNet2Rule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, g, b, w),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )


def recurrent_gdn2(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""Gated DeltaNet-2 token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_gdn2`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        GatedDeltaNet2Rule(
            chunk_size=1,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, g, b, w),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
    )

"""The delta rule (DeltaNet): the gated delta rule without a decay.

One token, per value head:

    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (I - k^T w) h + k^T u`.
"""

from typing import ClassVar

import equinox as eqx

from .._custom_types import CuSeqlens, GateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


class DeltaRule(AbstractDeltaRule):
    """The delta rule (DeltaNet): a delta update per token, no decay.

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g=None`,
    handed to [`deltanet_cp.run`][] beside it.

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
    gate: ClassVar[GateKind] = "none"
    householder: ClassVar[bool] = False


def chunk_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
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
    r"""The delta rule in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow h + k_t (\beta_t (v_t - h^\top k_t))^\top$,
    $o_t = h^\top (s\, q_t)$.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
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
        DeltaRule(
            chunk_size=chunk_size,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, None, beta),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )


def recurrent_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""The delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_delta_rule`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        DeltaRule(
            chunk_size=1,
            scale=scale,
            use_qk_l2norm=use_qk_l2norm,
            precision=precision,
        ),
        DeltaInputs(q, k, v, None, beta),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
    )

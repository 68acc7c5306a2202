"""The generalized delta rule's public functions: chunked and token by token.

The recurrence and its chunk algebra are in `_dplr.py`.
"""

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._run import Memory, run
from ._dplr import DPLRDeltaRule, DPLRInputs


def chunk_dplr_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
    memory: Memory | None = None,
) -> tuple[ValueTensor, States]:
    r"""The generalized delta rule in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow \mathrm{diag}(e^{gk_t}) h + b_t (a_t^\top h)
    + k_t v_t^\top$ ($a_t^\top h$ read before the token's decay), $o_t = h^\top (s\, q_t)$:
    $S_t = (\mathrm{diag}(e^{gk_t}) + b_t a_t^\top) S_{t-1} + k_t v_t^\top$, a
    diagonal-plus-low-rank transition. flash-linear-attention's
    `fla.ops.generalized_delta_rule.chunk_dplr_delta_rule` in name, argument order and
    result; RWKV-7's call shape is `deltanet_cp.interop.fla.chunk_rwkv7`.

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `a`: the direction the state is read along, shape `(B, T, H, K)` (RWKV-7: `-kk`).
    - `b`: the direction that read is written back along, shape `(B, T, H, K)` (RWKV-7:
        `kk * iclr`).
    - `gk`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `scale`, `initial_state`, `cu_seqlens`, `chunk_size`, `cp`, `precision`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    """
    return run(
        DPLRDeltaRule(
            chunk_size=chunk_size,
            scale=scale,
            precision=precision,
        ),
        DPLRInputs(q, k, v, a, b, gk),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
        memory=memory,
    )


def recurrent_dplr_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""The generalized delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_dplr_delta_rule`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        DPLRDeltaRule(
            chunk_size=1,
            scale=scale,
            precision=precision,
        ),
        DPLRInputs(q, k, v, a, b, gk),
        initial_state=initial_state,
        cu_seqlens=cu_seqlens,
        cp=cp,
    )

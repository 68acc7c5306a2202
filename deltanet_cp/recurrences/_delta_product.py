"""Gated DeltaProduct: `n_h` delta-rule (generalised Householder) steps per token.

One token, per value head (the convention of the DeltaProduct paper and of
flash-linear-attention: the decay once, before the `n_h` steps; the output after the last):

    h <- exp(g_t) h
    for j = 1..n_h:  h <- h + k_tj (beta_tj (v_tj - h^T k_tj))^T
    o_t = h^T (scale q_t)

In a chunk, the `n_h` steps of each token are `n_h` pseudo-tokens in a row (decay on the
first, output after the last): the delta rule's chunk algebra applies unchanged.
"""

from typing import ClassVar

import equinox as eqx
from jaxtyping import Array, Float

from .._custom_types import CuSeqlens, GateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


# Per-token tensors with the householder steps on axis 2.
ProductKeyTensor = Float[Array, "batch seq nh heads k"]
ProductValueTensor = Float[Array, "batch seq nh vheads v"]
ProductBetaTensor = Float[Array, "batch seq nh vheads"]


class GatedDeltaProductRule(AbstractDeltaRule):
    """Gated DeltaProduct: per token, one decay, then `n_h` delta updates.

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `k`
    `(B, T, n_h, H, K)`, `v` `(B, T, n_h, HV, V)`, `beta` `(B, T, n_h, HV)` and `g`
    `(B, T, HV)` or `None`, handed to [`deltanet_cp.run`][] beside it. With `n_h = 1` it
    is the gated delta rule.

    **Arguments:**

    - `chunk_size`: tokens per chunk (each makes `n_h` updates).
    - `scale`: query scale, a Python float (a traced one is refused); `K ** -0.5` if
        `None`.
    - `use_qk_l2norm`: L2-normalise `q` and every `k` over `K` (eps `1e-6`) first.
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
    gate: ClassVar[GateKind] = "optional"
    householder: ClassVar[bool] = True


def chunk_gated_delta_product(
    q: QKTensor,
    k: ProductKeyTensor,
    v: ProductValueTensor,
    g: GateTensor | None,
    beta: ProductBetaTensor,
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
    r"""Gated DeltaProduct in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow e^{g_t} h$, then for $j = 1, \dots, n_h$:
    $h \leftarrow h + k_{tj} (\beta_{tj} (v_{tj} - h^\top k_{tj}))^\top$; finally
    $o_t = h^\top (s\, q_t)$. The number of steps $n_h$ is axis 2 of `k`.
    flash-linear-attention's flat layout `(B, T * n_h, H, K)` is
    `k.reshape(B, T, n_h, H, K)` here (see `deltanet_cp.interop.fla`).

    **Arguments:**

    - `q`: queries, shape `(B, T, H, K)`.
    - `k`: keys, shape `(B, T, n_h, H, K)`.
    - `v`: values, shape `(B, T, n_h, HV, V)`; `HV` must be a multiple of `H` and value
        head `j` reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\le 0$, one per token and value head, `(B, T, HV)`, applied
        once before the token's steps; `None` for the ungated DeltaProduct.
    - `beta`: step sizes, shape `(B, T, n_h, HV)`; in $[0, 2]$ for householder
        reflections with negative eigenvalues, $[0, 1]$ otherwise.
    - `scale`, `initial_state`, `use_qk_l2norm`, `cu_seqlens`, `chunk_size`, `cp`,
        `precision`: as in
        [`deltanet_cp.chunk_gated_delta_rule`][].
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`, as in [`deltanet_cp.chunk_gated_delta_rule`][].
    """
    return run(
        GatedDeltaProductRule(
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


def recurrent_gated_delta_product(
    q: QKTensor,
    k: ProductKeyTensor,
    v: ProductValueTensor,
    g: GateTensor | None,
    beta: ProductBetaTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""Gated DeltaProduct token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_gated_delta_product`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        GatedDeltaProductRule(
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

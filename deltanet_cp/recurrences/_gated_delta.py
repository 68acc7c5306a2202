"""The gated delta rule (Gated DeltaNet; Qwen3-Next, Qwen3.5).

One token, per value head (decay first, then the delta update):

    h <- exp(g_t) h
    h <- h + k_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (gamma I - k~^T w) h + k~^T u`.
"""

from typing import ClassVar

import equinox as eqx

from .._custom_types import CuSeqlens, GateTensor, QKTensor, States, ValueTensor
from .._parallel import ContextParallel
from .._precision import as_precision, PrecisionName
from .._run import Memory, run
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


class GatedDeltaRule(AbstractDeltaRule):
    """The gated delta rule: a decay per token and value head, then a delta update.

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g` of
    shape `(B, T, HV)`, handed to [`deltanet_cp.run`][] beside it.

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
    gate: ClassVar[GateKind] = "head"
    householder: ClassVar[bool] = False


def chunk_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
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
    r"""The gated delta rule in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow e^{g_t} h$, then
    $h \leftarrow h + k_t (\beta_t (v_t - h^\top k_t))^\top$, $o_t = h^\top (s\, q_t)$.

    Any sequence length works (the last chunk is padded with identity steps). The state and
    the chunk algebra run in float32 (float64 for float64 inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays $\log \alpha_t \le 0$, shape `(B, T, HV)`.
    - `beta`: step sizes in $[0, 1]$ ($[0, 2]$ for negative eigenvalues), shape
        `(B, T, HV)`. Both ranges are checked where the values are concrete (see
        [`deltanet_cp.run`][]).
    - `scale`: query scale, default `K ** -0.5`: a Python float, part of the static
        configuration. The outputs are linear in it, so under `jax.jit` a traced scale is
        `scale=1.0` and `o * scale`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `cu_seqlens`: packed documents (batch size 1): the document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, a list or an int array of shape `(N + 1,)`
        (the flash-linear-attention convention). The state resets at each document start,
        no chunk mixes two documents, and `initial_state` / the final state are per
        document, `(N, HV, K, V)`.
    - `chunk_size`: tokens per chunk.
    - `cp`: how the call is sharded, as in [`deltanet_cp.ContextParallel`][]; `None`: one
        device.
    - `precision`: the products' policy: `"highest"`, `"bfloat16"` (bfloat16 operands,
        float32 accumulation), `"default"` (`jax.default_matmul_precision`), or `None`:
        `"bfloat16"` for bfloat16 inputs, `"highest"` otherwise (see
        [`deltanet_cp.GatedDeltaRule`][]). The state stays float32 under every policy.
    - `memory`: what the backward keeps, `"low"` (`None`, the default) or `"high"`: as in
        [`deltanet_cp.run`][].

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` (float32; float64 for float64 inputs) (with `cu_seqlens`, one
    per document).
    """
    return run(
        GatedDeltaRule(
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


def recurrent_gated_delta_rule(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: GateTensor,
    beta: GateTensor,
    *,
    scale: float | None = None,
    initial_state: States | None = None,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    cp: ContextParallel | None = None,
    precision: PrecisionName | None = None,
) -> tuple[ValueTensor, States]:
    r"""The gated delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_gated_delta_rule`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        GatedDeltaRule(
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

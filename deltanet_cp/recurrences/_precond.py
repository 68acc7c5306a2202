"""The main stage of the preconditioned delta rules: a delta rule that erases along the key
`k` and writes along a key of its own, `k^` (flash-linear-attention's
`precond_gated_delta_rule` and `precond_kda`, whose `k^ = k * m` comes from a diagonal
preconditioner; see `_cascade.py`).

One token, per value head, with `g_t` a log decay per head (Gated DeltaNet) or per key
channel (KDA):

    h <- diag(exp(g_t)) h
    h <- h + k^_t (beta_t (v_t - h^T k_t))^T
    o_t = h^T (scale q_t)

One chunk is an affine map of the incoming state, `h -> (diag(gamma) - k~^T w) h + k~^T u`,
with `A_ij = beta_i (k_i . k^_j) e^{G_i - G_j}` (i > j), `w = (I + A)^-1 (beta e^G k)`,
`u = (I + A)^-1 (beta v)` and `k~ = k^ e^{G_C - G}`: the shared delta-family algebra with the
write key in the Grams' right factor and in `k~`.
"""

from typing import ClassVar

import equinox as eqx

from .._precision import as_precision, PrecisionName
from .._validate import as_chunk_size, as_l2norm_flag, as_scale
from ._delta_family import AbstractDeltaRule, GateKind


class PrecondGatedDeltaRule(AbstractDeltaRule):
    """The gated delta rule that erases along `k` and writes along a key of its own: the main
    stage of [`deltanet_cp.chunk_precond_gated_delta_rule`][].

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g` of
    shape `(B, T, HV)` and the write key `write_key` of shape `(B, T, H, K)` (taken as
    given: `use_qk_l2norm` normalises `q` and `k` only), handed to [`deltanet_cp.run`][]
    beside it. With `write_key = k` it is [`deltanet_cp.GatedDeltaRule`][].

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale; `K ** -0.5` if `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `precision`: the products' policy, as in [`deltanet_cp.GatedDeltaRule`][].
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True, converter=as_l2norm_flag)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)
    gate: ClassVar[GateKind] = "head"
    householder: ClassVar[bool] = False
    write_key: ClassVar[bool] = True


class PrecondKimiDeltaRule(AbstractDeltaRule):
    """Kimi Delta Attention that erases along `k` and writes along a key of its own: the
    main stage of [`deltanet_cp.chunk_precond_kda`][].

    A static configuration; the inputs are a [`deltanet_cp.DeltaInputs`][] with `g` of
    shape `(B, T, HV, K)` and the write key `write_key` of shape `(B, T, H, K)` (taken as
    given), handed to [`deltanet_cp.run`][] beside it. With `write_key = k` it is
    [`deltanet_cp.KimiDeltaRule`][].

    **Arguments:**

    - `chunk_size`: tokens per chunk.
    - `scale`: query scale; `K ** -0.5` if `None`.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `precision`: the products' policy, as in [`deltanet_cp.GatedDeltaRule`][].
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True, converter=as_l2norm_flag)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)
    gate: ClassVar[GateKind] = "key"
    householder: ClassVar[bool] = False
    write_key: ClassVar[bool] = True

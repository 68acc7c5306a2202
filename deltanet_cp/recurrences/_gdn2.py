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

from typing import ClassVar, Literal, overload

import equinox as eqx
import jax

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, States, ValueTensor
from .._engine import run, run_sharded
from .._exchange import AbstractExchange, ExchangeName
from .._layout import Contiguous, Layout
from .._validate import as_chunk_size, as_scale
from ._delta_family import AbstractDeltaRule, DeltaInputs, GateKind


class GatedDeltaNet2(AbstractDeltaRule):
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
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=as_chunk_size)
    scale: float | None = eqx.field(default=None, static=True, converter=as_scale)
    use_qk_l2norm: bool = eqx.field(default=False, static=True)
    gate: ClassVar[GateKind] = "key"
    householder: ClassVar[bool] = False
    channel_gates: ClassVar[bool] = True


@overload
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
    output_final_state: Literal[True],
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
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
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


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
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""Gated DeltaNet-2 in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow \mathrm{diag}(e^{g_t}) h$, then
    $h \leftarrow h + k_t (w_t \odot v_t - h^\top (b_t \odot k_t))^\top$,
    $o_t = h^\top (s\, q_t)$: $S_t = (I - k_t (b_t \odot k_t)^\top) \mathrm{diag}(e^{g_t})
    S_{t-1} + k_t (w_t \odot v_t)^\top$. With $b_t = w_t = \beta_t$ it is
    [`deltanet_cp.chunk_kimi_delta_attention`][]. flash-linear-attention's
    `fla.ops.gdn2.chunk_gdn2` in name, argument order and result.

    Any sequence length works (the last chunk is padded with identity steps). The state and
    the chunk algebra run in float32 (float64 for float64 inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `g`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `b`: the erase gate, one per key channel (typically in $[0, 2]$), `(B, T, HV, K)`.
    - `w`: the write gate, one per value channel (typically in $[0, 1]$), `(B, T, HV, V)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
    - `use_qk_l2norm`: L2-normalise `q` and `k` over `K` (eps `1e-6`) first.
    - `cu_seqlens`: packed documents (batch size 1): the document offsets
        `[0, len_0, len_0 + len_1, ..., T]`, a list or an int array of shape `(N + 1,)`
        (the flash-linear-attention convention). The state resets at each document start,
        no chunk mixes two documents, and `initial_state` / the final state are per
        document, `(N, HV, K, V)`.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `(o, final_state)`: `o` of shape `(B, T, HV, V)` in `v`'s dtype, and the final state
    `(B, HV, K, V)` (float32; float64 for float64 inputs) if `output_final_state`, else
    `None`.
    """
    return run(
        GatedDeltaNet2(chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm),
        DeltaInputs(q, k, v, g, b, w),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


@overload
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
    output_final_state: Literal[True],
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States]: ...


@overload
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
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States | None]: ...


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
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""Gated DeltaNet-2 token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_gdn2`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        GatedDeltaNet2(chunk_size=1, scale=scale, use_qk_l2norm=use_qk_l2norm),
        DeltaInputs(q, k, v, g, b, w),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


@overload
def chunk_gdn2_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: Literal[True],
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
def chunk_gdn2_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


def chunk_gdn2_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""[`deltanet_cp.chunk_gdn2`][] with context parallelism (in `shard_map`).

    The sequence axis (axis 1 of every per-token argument) is sharded over `axis_name`,
    rank `r` holding its shard under `layout`; each argument here is this rank's shard (any number
    of tokens per rank). Ranks exchange one `(K, K)` + `(K, V)` map per batch element and value head
    (or less, depending on `exchange`): the payload does not grow with the sequence length.

    **Arguments:**

    - `q, k, v, g, b, w`, `scale`, `use_qk_l2norm`, `chunk_size`: as in
        [`deltanet_cp.chunk_gdn2`][], for this rank's tokens.
    - `initial_state`: the state before the first token of the whole sequence, replicated;
        zeros if `None`.
    - `output_final_state`: also return the state after the last token of the sequence
        (the same on every rank).
    - `cu_seqlens`: packed documents: the *global* document offsets, the same on every rank;
        documents may cross rank boundaries.
    - `axis_name`: the mesh axis the sequence is sharded over.
    - `layout`: [`deltanet_cp.Contiguous`][] (the default: rank `r` holds tokens
        `[r S / cp, (r + 1) S / cp)`) or [`deltanet_cp.Zigzag`][] (rank `r` holds pieces
        `r` and `2 cp - 1 - r` of `2 cp`, in that order; an even number of tokens per
        rank), the load-balanced layout of the attention layers of a hybrid model.
    - `exchange`: how ranks exchange their maps: [`deltanet_cp.AllGather`][] (the default),
        [`deltanet_cp.PPermute`][], [`deltanet_cp.Ring`][], [`deltanet_cp.Auto`][], or their
        shorthands `"allgather"`, `"ppermute"`, `"ring"`, `"auto"`.

    **Returns:**

    `(o, final_state)`: this rank's outputs `(B, T_local, HV, V)` in `v`'s dtype, and the
    global final state or `None`.
    """
    return run(
        GatedDeltaNet2(chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm),
        DeltaInputs(q, k, v, g, b, w),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        axis_name=axis_name,
        layout=layout,
        exchange=exchange,
    )


@overload
def chunk_gdn2_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: Literal[True],
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
def chunk_gdn2_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


def chunk_gdn2_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    g: KeyGateTensor,
    b: KeyGateTensor,
    w: ValueTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""[`deltanet_cp.chunk_gdn2_cp`][] on global arrays: does the `shard_map`.

    Shards the sequence axis over `axis_name` of `mesh` (and optionally the batch over
    `batch_axis`), runs the context-parallel kernel and returns global arrays. Compiled
    once per input shapes and mesh. Use it at the top level; inside your own `shard_map`,
    call `chunk_gdn2_cp`.

    **Arguments:**

    - `q, k, v, g, b, w`, `scale`, `initial_state`, `output_final_state`, `use_qk_l2norm`,
        `cu_seqlens`, `chunk_size`: as in [`deltanet_cp.chunk_gdn2`][],
        global arrays in sequence order whatever the layout. The sequence length must be
        divisible by the size of `axis_name` (by twice it under `Zigzag`).
    - `mesh`: a `jax.sharding.Mesh` with an axis named `axis_name`.
    - `axis_name`: the mesh axis to shard the sequence over.
    - `batch_axis`: optionally, a mesh axis to shard the batch over (data parallelism).
    - `layout`, `exchange`: as in [`deltanet_cp.chunk_gdn2_cp`][].

    **Returns:**

    `(o, final_state)` as global arrays.
    """
    return run_sharded(
        GatedDeltaNet2(chunk_size=chunk_size, scale=scale, use_qk_l2norm=use_qk_l2norm),
        DeltaInputs(q, k, v, g, b, w),
        mesh=mesh,
        axis_name=axis_name,
        batch_axis=batch_axis,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        layout=layout,
        exchange=exchange,
    )

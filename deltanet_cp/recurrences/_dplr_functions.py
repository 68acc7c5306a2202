"""The generalized delta rule's public functions: chunked, token by token, context-parallel.

The recurrence and its chunk algebra are in `_dplr.py`.
"""

from typing import Literal, overload

import jax

from .._custom_types import CuSeqlens, KeyGateTensor, QKTensor, States, ValueTensor
from .._engine import run, run_sharded
from .._exchange import AbstractExchange, ExchangeName
from .._layout import Contiguous, Layout
from ._dplr import DPLRDeltaRule, DPLRInputs


@overload
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
    output_final_state: Literal[True],
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
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
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


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
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""The generalized delta rule in chunked (WY) form: the training path.

    Per token and value head: $h \leftarrow \mathrm{diag}(e^{gk_t}) h + b_t (a_t^\top h)
    + k_t v_t^\top$ ($a_t^\top h$ read before the token's decay), $o_t = h^\top (s\, q_t)$:
    $S_t = (\mathrm{diag}(e^{gk_t}) + b_t a_t^\top) S_{t-1} + k_t v_t^\top$, a
    diagonal-plus-low-rank transition. flash-linear-attention's
    `fla.ops.generalized_delta_rule.chunk_dplr_delta_rule` in name, argument order and
    result; RWKV-7's call shape is `deltanet_cp.interop.fla.chunk_rwkv7`.

    Any sequence length works (the last chunk is padded with identity steps). The state and
    the chunk algebra run in float32 (float64 for float64 inputs).

    **Arguments:**

    - `q`, `k`: queries and keys, shape `(B, T, H, K)`.
    - `v`: values, shape `(B, T, HV, V)`; `HV` must be a multiple of `H` and value head `j`
        reads key head `j // (HV // H)`.
    - `a`: the direction the state is read along, shape `(B, T, H, K)` (RWKV-7: `-kk`).
    - `b`: the direction that read is written back along, shape `(B, T, H, K)` (RWKV-7:
        `kk * iclr`).
    - `gk`: natural-log decays per key channel, $\le 0$, shape `(B, T, HV, K)`.
    - `scale`: query scale, default `K ** -0.5`.
    - `initial_state`: the state before the first token, `(B, HV, K, V)`; zeros if `None`.
    - `output_final_state`: also return the state after the last token.
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
        DPLRDeltaRule(chunk_size=chunk_size, scale=scale),
        DPLRInputs(q, k, v, a, b, gk),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


@overload
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
    output_final_state: Literal[True],
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States]: ...


@overload
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
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States | None]: ...


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
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
) -> tuple[ValueTensor, States | None]:
    r"""The generalized delta rule token by token: the decoding path.

    The same recurrence as [`deltanet_cp.chunk_dplr_delta_rule`][], one token per step
    (the engine with `chunk_size=1`: a `lax.scan` over tokens); the same arguments
    (without `chunk_size`) and results.
    """
    return run(
        DPLRDeltaRule(chunk_size=1, scale=scale),
        DPLRInputs(q, k, v, a, b, gk),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
    )


@overload
def chunk_dplr_delta_rule_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: Literal[True],
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
def chunk_dplr_delta_rule_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


def chunk_dplr_delta_rule_cp(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    axis_name: str,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""[`deltanet_cp.chunk_dplr_delta_rule`][] with context parallelism (in `shard_map`).

    The sequence axis (axis 1 of every per-token argument) is sharded over `axis_name`,
    rank `r` holding its shard under `layout`; each argument here is this rank's shard (any number
    of tokens per rank). Ranks exchange one `(K, K)` + `(K, V)` map per batch element and value head
    (or less, depending on `exchange`): the payload does not grow with the sequence length.

    **Arguments:**

    - `q, k, v, a, b, gk`, `scale`, `chunk_size`: as in
        [`deltanet_cp.chunk_dplr_delta_rule`][], for this rank's tokens.
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
        DPLRDeltaRule(chunk_size=chunk_size, scale=scale),
        DPLRInputs(q, k, v, a, b, gk),
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        axis_name=axis_name,
        layout=layout,
        exchange=exchange,
    )


@overload
def chunk_dplr_delta_rule_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: Literal[True],
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States]: ...


@overload
def chunk_dplr_delta_rule_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]: ...


def chunk_dplr_delta_rule_sharded(
    q: QKTensor,
    k: QKTensor,
    v: ValueTensor,
    a: QKTensor,
    b: QKTensor,
    gk: KeyGateTensor,
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    batch_axis: str | None = None,
    layout: Layout = Contiguous(),
    exchange: AbstractExchange | ExchangeName = "allgather",
    scale: float | None = None,
    initial_state: States | None = None,
    output_final_state: bool = False,
    cu_seqlens: CuSeqlens | None = None,
    chunk_size: int = 64,
) -> tuple[ValueTensor, States | None]:
    r"""[`deltanet_cp.chunk_dplr_delta_rule_cp`][] on global arrays: does the `shard_map`.

    Shards the sequence axis over `axis_name` of `mesh` (and optionally the batch over
    `batch_axis`), runs the context-parallel kernel and returns global arrays. Compiled
    once per input shapes and mesh. Use it at the top level; inside your own `shard_map`,
    call `chunk_dplr_delta_rule_cp`.

    **Arguments:**

    - `q, k, v, a, b, gk`, `scale`, `initial_state`, `output_final_state`,
        `cu_seqlens`, `chunk_size`: as in [`deltanet_cp.chunk_dplr_delta_rule`][],
        global arrays in sequence order whatever the layout. The sequence length must be
        divisible by the size of `axis_name` (by twice it under `Zigzag`).
    - `mesh`: a `jax.sharding.Mesh` with an axis named `axis_name`.
    - `axis_name`: the mesh axis to shard the sequence over.
    - `batch_axis`: optionally, a mesh axis to shard the batch over (data parallelism).
    - `layout`, `exchange`: as in [`deltanet_cp.chunk_dplr_delta_rule_cp`][].

    **Returns:**

    `(o, final_state)` as global arrays.
    """
    return run_sharded(
        DPLRDeltaRule(chunk_size=chunk_size, scale=scale),
        DPLRInputs(q, k, v, a, b, gk),
        mesh=mesh,
        axis_name=axis_name,
        batch_axis=batch_axis,
        initial_state=initial_state,
        output_final_state=output_final_state,
        cu_seqlens=cu_seqlens,
        layout=layout,
        exchange=exchange,
    )

"""A sparse mixture-of-experts feed-forward layer (Qwen3-Next / Qwen3.5 MoE): a softmax top-k
router, SwiGLU experts run dropless as grouped matmuls, and a gated shared expert."""

import functools as ft
from typing import cast, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, PyTree

from .._precision import accumulation_dtype
from .._sharding import cotangent_like, varying, varying_axes
from .._validate import as_flag, as_positive_index
from ._mlp import SwiGLU


# The mesh axis (or axes) a layer's experts are split over inside `jax.shard_map`.
ExpertAxis = str | tuple[str, ...] | None


class RouterStats(eqx.Module):
    """What the load-balancing loss needs of a mixture-of-experts layer's routing: sums over
    tokens.

    Sums add up: over the layers of a model, the sequences of a batch (`jax.tree.map(lambda
    a: a.sum(0), stats)` after `jax.vmap`) and context-parallel ranks (`jax.lax.psum`), and
    [`deltanet_cp.nn.load_balancing_loss`][] normalises at the end, as transformers does over
    all layers' tokens together.

    **Fields:**

    - `counts`: `(experts,)`, how many times each expert was chosen (each token chooses
        `top_k`), float32.
    - `probabilities`: `(experts,)`, the router's probabilities (softmax over all experts)
        summed over the tokens, float32. For the sigmoid router
        ([`deltanet_cp.nn.SigmoidTopKRouter`][]), each token's sigmoid scores divided by
        their sum over the experts (DeepSeek-V3's normalised affinities $s'$).
    - `tokens`: how many tokens (routing decisions) the sums are over, float32 (with a
        `token_mask`, the masked ones).

    For the sigmoid router, transformers' Kimi Linear computes no load-balancing loss
    (its configs have no `router_aux_loss_coef`): Kimi Linear balances its experts without
    one, by the router's `e_score_correction_bias`, which a training loop moves from the
    `counts` (see [`deltanet_cp.nn.SigmoidTopKRouter`][]). With these probabilities,
    [`deltanet_cp.nn.load_balancing_loss`][] is `top_k` times DeepSeek-V3's complementary
    sequence-wise balance loss (without its weight) over the tokens summed, for those who
    want one.
    """

    counts: Float[Array, " experts"]
    probabilities: Float[Array, " experts"]
    tokens: Float[Array, ""]


def load_balancing_loss(stats: RouterStats) -> Float[Array, ""]:
    r"""The Switch Transformer load-balancing loss of `stats`, as transformers'
    `load_balancing_loss_func` (the router's softmax taken once):

    $$E \sum_e f_e \, P_e, \qquad f_e = \frac{\mathrm{counts}_e}{N}, \quad
    P_e = \frac{\mathrm{probabilities}_e}{N},$$

    with $E$ experts and $N$ = `stats.tokens`. A model's training loss adds it times its
    `router_aux_loss_coef`. Uniform routing gives `top_k`.

    **Arguments:**

    - `stats`: a [`deltanet_cp.nn.RouterStats`][], summed over the layers (and sequences,
        ranks) to balance together.

    **Returns:**

    A float32 scalar.
    """
    n = stats.tokens
    return stats.counts.shape[-1] * jnp.sum((stats.counts / n) * (stats.probabilities / n))


def _tile_rows(active_pairs: int, num_experts: int) -> int:
    """Rows per tile of the routed experts' loop: the largest power of two up to 128 with
    every expert's padding (less than one tile each) at most a quarter of the active
    pairs, so the rows computed are at most 1.25x the routed ones; at least 8."""
    tile = 128
    while tile > 8 and 4 * num_experts * tile > active_pairs:
        tile //= 2
    return tile


def _tile(n, group_sizes, tile: int):
    """Tile `n` of the loop: its expert, first row (of the pairs sorted by expert) and how
    many of its `tile` rows are that expert's."""
    per = (group_sizes + tile - 1) // tile  # tiles per expert
    ends = jnp.cumsum(per)
    e = jnp.minimum(jnp.searchsorted(ends, n, side="right"), group_sizes.shape[0] - 1)
    group_start = jnp.cumsum(group_sizes) - group_sizes
    start = group_start[e] + (n - (ends[e] - per[e])) * tile
    return e, start, group_start[e] + group_sizes[e] - start, ends[-1]


def _rows(token, weight, x, start, valid, tile: int):
    """The `tile` pairs from `start`: their tokens, weights, which are valid, and the
    tokens' rows of `x` (zero where not valid)."""
    idx = jax.lax.dynamic_slice_in_dim(token, start, tile)
    wt = jax.lax.dynamic_slice_in_dim(weight, start, tile)
    ok = jnp.arange(tile, dtype=valid.dtype) < valid
    return idx, wt, ok, jnp.where(ok[:, None], x[idx], 0)


def _swiglu(xs, gate, up, down):
    a, b = xs @ gate.T, xs @ up.T
    return a, b, (jax.nn.silu(a) * b) @ down.T


@ft.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _routed(tile: int, x, token, weight, group_sizes, gate, up, down):
    """`y[t] = sum_p weight[p] * expert_{e(p)}(x[t])` over the pairs `p` of token `t`.

    `token` and `weight` hold the `(token, expert)` pairs sorted by expert, `group_sizes`
    how many pairs each expert has (pairs after them are not computed), both padded by
    `tile` at the end. A loop over tiles of `tile` pairs of one expert each: the rows
    computed are the routed ones plus under one tile per expert (no product over every
    expert, as XLA:CPU's `ragged_dot` lowering forms). `x` and the weights in one dtype;
    the sums in the accumulation dtype (float64 for float64 operands, else float32);
    `x`'s dtype out.
    """
    return _routed_fwd(tile, x, token, weight, group_sizes, gate, up, down)[0]


def _routed_fwd(tile, x, token, weight, group_sizes, gate, up, down):
    """The output, and as residuals the inputs and every pair's two projections (`gate`
    and `up`, in pair order): the backward then forms only the products autodiff would."""
    primals = (x, token, weight, group_sizes, gate, up, down)
    acc = accumulation_dtype(x, weight)
    total = _tile(0, group_sizes, tile)[3]

    def body(n, carry):
        y, pa, pb = carry
        e, start, valid, _ = _tile(n, group_sizes, tile)
        idx, wt, ok, xs = _rows(token, weight, x, start, valid, tile)
        a, b, ys = _swiglu(xs, gate[e], up[e], down[e])
        keep = ok[:, None]
        pa = _put_rows(pa, jnp.where(keep, a, 0), start, keep)
        pb = _put_rows(pb, jnp.where(keep, b, 0), start, keep)
        ys = ys.astype(acc) * wt[:, None].astype(acc)
        return y.at[idx].add(jnp.where(keep, ys, 0)), pa, pb

    rows = (token.shape[0], gate.shape[1])
    carry = (jnp.zeros(x.shape, acc), jnp.zeros(rows, x.dtype), jnp.zeros(rows, x.dtype))
    y, pa, pb = jax.lax.fori_loop(0, total, body, varying(carry, primals))
    return y.astype(x.dtype), (primals, pa, pb)


def _put_rows(array, rows, start, keep):
    """`array` with `rows` written from row `start` where `keep` (a tile's last rows may
    be the next expert's, written by its own tile)."""
    old = jax.lax.dynamic_slice_in_dim(array, start, rows.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(array, jnp.where(keep, rows, old), start, 0)


def _routed_bwd(tile, residuals, dy):
    primals, pa, pb = residuals
    x, token, weight, group_sizes, gate, up, down = primals
    acc = accumulation_dtype(x, weight)
    total = _tile(0, group_sizes, tile)[3]

    def body(n, sums):
        dx, dw, dg, du, dd = sums
        e, start, valid, _ = _tile(n, group_sizes, tile)
        idx, wt, ok, xs = _rows(token, weight, x, start, valid, tile)
        dys = jnp.where(ok[:, None], dy[idx], 0)
        # The rows that enter the products: this expert's pairs (a tile's last rows may be
        # the next expert's, whose projections `pa`, `pb` hold) whose token has a
        # cotangent. The others are zeroed before any product, so that they add exact
        # zeros even where their activations overflowed (0 x inf would be NaN).
        keep = (ok & jnp.any(dys != 0, axis=-1))[:, None]
        xs = jnp.where(keep, xs, 0)
        a = jax.lax.dynamic_slice_in_dim(pa, start, tile)
        b = jax.lax.dynamic_slice_in_dim(pb, start, tile)
        s = jax.nn.silu(a)
        h = s * b
        # The cotangent of the expert's output is `wt * dys`: through the down projection,
        # `wt * (dys @ down)`; the routing weight's, `dys . (h @ down.T) = (dys @ down) . h`.
        back = dys @ down[e]
        dwt = jnp.sum(back.astype(acc) * h.astype(acc), axis=-1)
        dw = _put_rows(dw, jnp.where(keep[:, 0], dwt, 0), start, ok)
        h = jnp.where(keep, h, 0)
        w = wt[:, None].astype(dys.dtype)
        dh = back * w
        sig = jax.nn.sigmoid(a)
        da = jnp.where(keep, dh * b * (sig * (1 + a * (1 - sig))), 0)
        db = jnp.where(keep, dh * s, 0)
        dd = dd.at[e].add(((dys * w).T @ h).astype(acc))
        dg = dg.at[e].add((da.T @ xs).astype(acc))
        du = du.at[e].add((db.T @ xs).astype(acc))
        dx = dx.at[idx].add(jnp.where(keep, da @ gate[e] + db @ up[e], 0).astype(acc))
        return dx, dw, dg, du, dd

    sums = (
        jnp.zeros(x.shape, acc),
        jnp.zeros(weight.shape, acc),
        jnp.zeros(gate.shape, acc),
        jnp.zeros(up.shape, acc),
        jnp.zeros(down.shape, acc),
    )
    sums = jax.lax.fori_loop(0, total, body, varying(sums, (*primals, dy)))
    dx, dw, dg, du, dd = sums
    cts = (
        dx.astype(x.dtype),
        None,
        dw.astype(weight.dtype),
        None,
        dg.astype(gate.dtype),
        du.astype(up.dtype),
        dd.astype(down.dtype),
    )
    return cotangent_like(cts, primals)


_routed.defvjp(_routed_fwd, _routed_bwd)


def _as_expert_axis(expert_axis: object) -> ExpertAxis:
    """`expert_axis` as passed: `None`, a mesh axis name or a non-empty tuple of names;
    a `TypeError` naming the argument otherwise."""
    if expert_axis is None or isinstance(expert_axis, str):
        return expert_axis
    if (
        isinstance(expert_axis, tuple)
        and expert_axis
        and all(isinstance(a, str) for a in expert_axis)
    ):
        return expert_axis
    raise TypeError(
        "`expert_axis` must be None, the name of a mesh axis of the enclosing "
        f"`jax.shard_map` (a str) or a non-empty tuple of names; got {expert_axis!r} of type "
        f"{type(expert_axis).__name__}."
    )


def _axis_size(expert_axis: str | tuple[str, ...]) -> int:
    """The ranks of `expert_axis`; a `ValueError` if the enclosing `jax.shard_map` has no
    such axis."""
    try:
        return jax.lax.axis_size(expert_axis)
    except NameError:
        raise ValueError(
            f"`expert_axis={expert_axis!r}` names a mesh axis of an enclosing "
            "`jax.shard_map`, and there is none of that name here. Call the layer inside "
            "`jax.shard_map` over a mesh with that axis, or pass `expert_axis=None`."
        ) from None


def _common_dtype(*dtypes) -> np.dtype:
    """The dtype that holds all of `dtypes` (JAX's standard promotion, whatever the
    configured one: float16 and bfloat16 meet in float32)."""
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(ft.reduce(jnp.promote_types, dtypes))


def _check_x(x: object, hidden: int) -> None:
    """A `ValueError` naming `x` unless it is a floating-point `(seq, hidden)` array."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            "`x` must be a floating-point array (seq, hidden); got "
            f"{type(x).__name__ if dtype is None else dtype}. Cast it with `.astype(...)`."
        )
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 2 or shape[1] != hidden:
        raise ValueError(
            f"`x` must have shape (seq, hidden) with hidden = {hidden}; got {shape}. It "
            "takes one sequence: `jax.vmap` it over a batch."
        )


def _check_ids(experts: Array, count: int, expert_axis: ExpertAxis) -> Array:
    """`experts` with its ids checked to be in `[0, count)`: concrete ones with a
    `ValueError`, traced ones through `equinox.error_if` (reduced over the mesh axes they
    vary over, so that every rank fails together). A gather would silently clamp them."""
    where = "" if expert_axis is None else f" (over the ranks of `expert_axis={expert_axis!r}`)"
    message = f"`experts` must be expert ids in [0, {count}){where}"
    try:
        values = np.asarray(experts)
    except jax.errors.TracerArrayConversionError:
        values = None
    if values is not None:
        bad = np.argwhere((values < 0) | (values >= count))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"{message}; got {int(values[at])} at {at} ({len(bad)} id(s) out of range). "
                "A gather would silently clamp it: fix the ids."
            )
        return experts
    bad = jnp.any((experts < 0) | (experts >= count))
    axes = tuple(sorted(varying_axes(bad), key=str))
    if axes:
        bad = jax.lax.psum(bad.astype(jnp.int32), axes) > 0
    # The check is made on a replicated zero added to the ids.
    zero = eqx.error_if(jnp.zeros((), experts.dtype), bad, message + ".")
    return experts + zero


class SwiGLUExperts(eqx.Module):
    """`E` SwiGLU MLPs, `down_e(silu(gate_e(x)) * up_e(x))`, their weights stacked; each token
    goes through the experts it is routed to.

    Dropless and at the routed FLOPs: the `(token, expert)` pairs are sorted by expert and
    a loop runs over tiles of one expert's pairs (up to 128 rows, fewer when the experts
    are many for the tokens), so the rows computed are the routed ones plus under one tile
    per expert, at most 1.25x the routed ones when the tokens times `top_k` are at least
    32 per expert. Gradients (a hand-written backward over the same tiles) flow to the
    weights, the tokens and the routing weights (not to the choice of experts, an integer);
    forward-mode differentiation is not supported. A token whose output cotangent is zero
    (masked out of the loss before any nonlinearity) adds exact zeros to every gradient,
    even where its activations overflow; a non-finite value of a token reaches the
    gradients of the experts it is routed to only.

    The experts compute in their weights' dtype (`x` is cast to it), their sums in float32
    (float64 for float64 weights or routing weights), and return `x`'s dtype.

    With `expert_axis`, the experts are split over the ranks of that mesh axis (or axes)
    inside `jax.shard_map`: this module holds the rank's slice of them (`E / ranks`
    experts, rank `r` the `r`-th, as `jax.shard_map` hands out a leaf sharded over the
    axis on its first dimension: see [`deltanet_cp.nn.expert_partition_specs`][]).
    """

    gate_proj: Float[Array, "experts intermediate hidden"]
    up_proj: Float[Array, "experts intermediate hidden"]
    down_proj: Float[Array, "experts hidden intermediate"]

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `num_experts`: `E`.
        - `hidden_size`: the model width.
        - `intermediate_size`: each expert's hidden width.
        - `key`: a PRNG key for the initial parameters (uniform in $\\pm 1/\\sqrt{\\text{in}}$,
            as `equinox.nn.Linear`).
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        The weights are in torch's `(out, in)` layout per expert: `gate_proj` and `up_proj`
        `(E, intermediate, hidden)`, `down_proj` `(E, hidden, intermediate)`.
        """
        e = as_positive_index(num_experts, "num_experts")
        h = as_positive_index(hidden_size, "hidden_size")
        i = as_positive_index(intermediate_size, "intermediate_size")
        dtype = jnp.zeros(()).dtype if dtype is None else dtype
        kg, ku, kd = jr.split(key, 3)

        def init(k, shape):
            lim = 1 / shape[-1] ** 0.5
            return jr.uniform(k, shape, dtype, -lim, lim)

        self.gate_proj = init(kg, (e, i, h))
        self.up_proj = init(ku, (e, i, h))
        self.down_proj = init(kd, (e, h, i))

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        experts: Int[Array, "seq k"],
        weights: Float[Array, "seq k"],
        *,
        expert_axis: ExpertAxis = None,
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: the tokens (this rank's, with `expert_axis`).
        - `experts`: the experts each token goes to, ids in `[0, E)` of all the experts.
        - `weights`: the weight of each of those experts' outputs.
        - `expert_axis`: `None` (this module holds every expert), or the name (or a tuple
            of names) of the mesh axes inside `jax.shard_map` the experts are split over:
            the tokens of all those ranks are gathered, each rank runs its experts' pairs,
            and the outputs are summed back onto the ranks of their tokens
            (`jax.lax.all_gather`, then `jax.lax.psum_scatter`).

        **Returns:**

        $\\sum_j$ `weights[t, j]` $\\cdot$ `expert[experts[t, j]](x[t])` for every token `t`,
        in `x`'s dtype.

        **Raises:**

        `TypeError` for `experts` not of an integer dtype or an `expert_axis` that is not a
        name or a tuple of names. `ValueError` for `x` not `(seq, hidden)`, `experts` and
        `weights` not `(seq, k)` for `x`'s `seq`, an id outside `[0, E)` (under `jax.jit`
        through `equinox.error_if`, when the computation runs), an `expert_axis` that names
        no axis of the enclosing `jax.shard_map`, or experts whose weights vary over other
        mesh axes than `expert_axis` (they are split over those: name them).
        """
        expert_axis = _as_expert_axis(expert_axis)
        self._check_arguments(x, experts, weights)
        ranks = 1 if expert_axis is None else _check_placement(self, expert_axis, None)
        experts = _check_ids(experts, self.num_experts * ranks, expert_axis)
        return self._apply(x, experts, weights, expert_axis).astype(x.dtype)

    def _check_arguments(self, x, experts, weights) -> None:
        _check_x(x, self.gate_proj.shape[2])
        dtype = getattr(experts, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
            raise TypeError(
                "`experts` must be an integer array of expert ids, (seq, k); got "
                f"{type(experts).__name__ if dtype is None else dtype}. Pass the router's "
                "choice (`SparseMoE.route`), or cast whole-number ids with `.astype(jnp.int32)`."
            )
        shape = tuple(experts.shape)
        if len(shape) != 2 or shape[0] != x.shape[0]:
            raise ValueError(
                f"`experts` must have shape (seq, k) with seq = {x.shape[0]}, one row of ids "
                f"per token of `x`; got {shape}."
            )
        wdtype = getattr(weights, "dtype", None)
        if wdtype is None or not jnp.issubdtype(wdtype, jnp.floating):
            raise ValueError(
                "`weights` must be a floating-point array (seq, k), the weight of each chosen "
                f"expert; got {type(weights).__name__ if wdtype is None else wdtype}."
            )
        if tuple(weights.shape) != shape:
            raise ValueError(
                f"`weights` must have the shape of `experts`, {shape}: one weight per chosen "
                f"expert; got {tuple(weights.shape)}."
            )

    def _apply(self, x, experts, weights, expert_axis: ExpertAxis) -> Array:
        """The routed output in the experts' dtype, the arguments checked."""
        dtype = _common_dtype(*(w.dtype for w in self._weights()))
        t, k = experts.shape
        if t == 0:
            return varying(jnp.zeros(x.shape, dtype), x)
        x = x.astype(dtype)
        held = self.num_experts
        if expert_axis is None:
            rank = 0
        else:
            x, experts, weights = (
                jax.lax.all_gather(a, expert_axis, tiled=True) for a in (x, experts, weights)
            )
            rank = jax.lax.axis_index(expert_axis)
        local = experts.reshape(-1) - rank * held
        mine = (local >= 0) & (local < held)
        local = jnp.where(mine, local, held)  # other ranks' pairs sort last, uncomputed
        order = jnp.argsort(local, stable=True)
        group_sizes = jnp.bincount(local, length=held + 1)[:held].astype(jnp.int32)
        tile = _tile_rows(t * k, held)
        token = jnp.pad((order // k).astype(jnp.int32), (0, tile))
        weight = jnp.pad(jnp.where(mine, weights.reshape(-1), 0)[order], (0, tile))
        gate, up, down = (w.astype(dtype) for w in self._weights())
        y = cast(Array, _routed(tile, x, token, weight, group_sizes, gate, up, down))
        if expert_axis is not None:
            y = jax.lax.psum_scatter(y, expert_axis, tiled=True)
        return y

    def _weights(self):
        return self.gate_proj, self.up_proj, self.down_proj


class SigmoidTopKRouter(eqx.Module):
    r"""The router of Kimi Linear (and DeepSeek-V3): sigmoid scores, a bias that steers the
    choice of experts but not their weights, and grouped top-k.

    Per token, in float32: scores $s = \sigma(W x)$; the choice scores $s + b$ (`b` the
    `e_score_correction_bias`); the experts in `n_group` groups of equal size, each group
    scored by the sum of its two best choice scores; the `topk_group` best groups kept;
    the `top_k` best choice scores among their experts chosen; each chosen expert's weight
    its score $s_e$ (without the bias), divided by the chosen scores' sum (plus
    $10^{-20}$) if `norm_topk_prob`, times `routed_scaling_factor`. What transformers'
    `KimiLinearTopkRouter` computes.

    The bias enters only through the choice (integer ids): its gradient is zero. Kimi
    Linear and DeepSeek-V3 train it outside the loss ("auxiliary-loss-free" balancing:
    after each step, raise the bias of the experts chosen less than average and lower it
    for those chosen more, from the counts of [`deltanet_cp.nn.RouterStats`][]); keep it
    out of weight decay.

    **Fields:**

    - `weight`: `(experts, hidden)`, float32 whatever the model's dtype (transformers keeps
        it in float32).
    - `e_score_correction_bias`: `(experts,)`, float32.
    """

    weight: Float[Array, "experts hidden"]
    e_score_correction_bias: Float[Array, " experts"]
    top_k: int = eqx.field(static=True)
    n_group: int = eqx.field(static=True)
    topk_group: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)
    routed_scaling_factor: float = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
        key: PRNGKeyArray,
    ):
        r"""**Arguments:**

        - `hidden_size`: the model width.
        - `num_experts`: `E`.
        - `top_k`: the experts each token is routed to.
        - `n_group`: the groups the experts are split into (`E` a multiple of it, at least
            two experts per group when `n_group > 1`).
        - `topk_group`: the groups kept per token, at most `n_group`; their experts must
            number at least `top_k`.
        - `norm_topk_prob`: divide the chosen scores by their sum.
        - `routed_scaling_factor`: multiply the weights by it.
        - `key`: a PRNG key for the weight (uniform in $\pm 1/\sqrt{\text{hidden}}$); the
            bias starts at zeros.

        **Raises:**

        `ValueError` naming the argument if the grouping does not fit the experts.
        """
        h = as_positive_index(hidden_size, "hidden_size")
        e = as_positive_index(num_experts, "num_experts")
        k = as_positive_index(top_k, "top_k")
        groups = as_positive_index(n_group, "n_group")
        kept = as_positive_index(topk_group, "topk_group")
        if e % groups or (groups > 1 and e // groups < 2):
            raise ValueError(
                f"`n_group` ({groups}) must divide the {e} experts into groups of at least two "
                "(each group is scored by its two best experts)."
            )
        if kept > groups or k > kept * (e // groups):
            raise ValueError(
                f"`topk_group` ({kept}) must be at most `n_group` ({groups}) and keep at least "
                f"`top_k` ({k}) experts ({e // groups} per group)."
            )
        lim = 1 / h**0.5
        self.weight = jr.uniform(key, (e, h), jnp.float32, -lim, lim)
        self.e_score_correction_bias = jnp.zeros((e,), jnp.float32)
        self.top_k = k
        self.n_group = groups
        self.topk_group = kept
        self.norm_topk_prob = as_flag(norm_topk_prob, "`norm_topk_prob`")
        self.routed_scaling_factor = float(routed_scaling_factor)

    def __call__(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq experts"], Int[Array, "seq k"], Float[Array, "seq k"]]:
        """**Arguments:**

        - `x`: the tokens, `(seq, hidden)`.

        **Returns:**

        `(scores, experts, weights)`: the sigmoid scores of every expert, the `top_k`
        chosen experts (best choice score first; ties to the lower id) and their weights,
        float32 (float64 for a float64 router).
        """
        w = self.weight
        ct = accumulation_dtype(w)
        logits = jnp.matmul(x.astype(ct), w.astype(ct).T, precision=jax.lax.Precision.HIGHEST)
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.astype(ct)[None]
        t, e = choice.shape
        if self.topk_group < self.n_group:
            grouped = choice.reshape(t, self.n_group, e // self.n_group)
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, kept = jax.lax.top_k(group_scores, self.topk_group)
            keep = jnp.any(kept[:, :, None] == jnp.arange(self.n_group)[None, None], axis=1)
            keep = jnp.repeat(keep, e // self.n_group, axis=-1)
            choice = jnp.where(keep, choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return scores, experts, weights * self.routed_scaling_factor


class SparseMoE(eqx.Module):
    """The sparse mixture-of-experts block of Qwen3-Next, Qwen3.5 MoE and Kimi Linear.

    Per token, with the default softmax router: router logits `gate(x)` (`(E,)`, no bias);
    a softmax over all `E` experts in float32; the `top_k` most probable experts, their
    probabilities renormalised to sum to one if `norm_topk_prob`; the routed experts'
    outputs weighted by them ([`deltanet_cp.nn.SwiGLUExperts`][]); plus a shared expert
    (a SwiGLU MLP) scaled by `sigmoid(shared_expert_gate(x))`. What transformers'
    `Qwen3NextSparseMoeBlock` / `Qwen3_5MoeSparseMoeBlock` compute.

    With `router="sigmoid"` the router is a [`deltanet_cp.nn.SigmoidTopKRouter`][]
    (sigmoid scores, a bias for the choice only, grouped top-k, a scaling factor), and
    with `shared_expert_gate=False` the shared expert's output is added ungated: what
    transformers' `KimiLinearMoE` computes.

    Called on one sequence, `(seq, hidden)`, it also returns the routing's
    [`deltanet_cp.nn.RouterStats`][], for [`deltanet_cp.nn.load_balancing_loss`][].
    """

    gate: eqx.nn.Linear | SigmoidTopKRouter
    experts: SwiGLUExperts
    shared_expert: SwiGLU
    shared_expert_gate: eqx.nn.Linear | None
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        *,
        norm_topk_prob: bool = True,
        router: Literal["softmax", "sigmoid"] = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        shared_expert_gate: bool = True,
        key: PRNGKeyArray,
        dtype=None,
    ):
        """**Arguments:**

        - `hidden_size`: the model width.
        - `num_experts`: `E`, the routed experts.
        - `top_k`: the experts each token is routed to, at most `E`.
        - `intermediate_size`: each routed expert's hidden width.
        - `shared_intermediate_size`: the shared expert's hidden width.
        - `norm_topk_prob`: renormalise the `top_k` probabilities to sum to one (Qwen3.5
            MoE always does; Qwen3-Next's config says).
        - `router`: `"softmax"` (Qwen's: `gate` an `equinox.nn.Linear`) or `"sigmoid"`
            (Kimi Linear's: `gate` a [`deltanet_cp.nn.SigmoidTopKRouter`][], float32).
        - `n_group`, `topk_group`, `routed_scaling_factor`: the sigmoid router's grouped
            top-k and scale (see [`deltanet_cp.nn.SigmoidTopKRouter`][]); only with
            `router="sigmoid"`.
        - `shared_expert_gate`: scale the shared expert by `sigmoid(shared_expert_gate(x))`
            (Qwen's), or add it ungated (`False`, Kimi Linear's).
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None` (the sigmoid
            router is float32 whatever it is).

        **Raises:**

        `ValueError` if `top_k` is not in `[1, num_experts]`, `norm_topk_prob` or
        `shared_expert_gate` is not a bool, `router` is not one of the two, or the grouping
        is given to the softmax router or does not fit the experts.
        """
        e = as_positive_index(num_experts, "num_experts")
        k = as_positive_index(top_k, "top_k")
        if k > e:
            raise ValueError(
                f"`top_k` ({k}) is more than the {e} experts: each token is routed to `top_k` "
                f"distinct experts, so pass at most {e}."
            )
        if router not in ("softmax", "sigmoid"):
            raise ValueError(f"`router` must be 'softmax' or 'sigmoid'; got {router!r}.")
        if router == "softmax" and (n_group, topk_group, routed_scaling_factor) != (1, 1, 1.0):
            raise ValueError(
                "`n_group`, `topk_group` and `routed_scaling_factor` are the sigmoid router's; "
                "pass `router='sigmoid'` or leave them at their defaults."
            )
        gated = as_flag(shared_expert_gate, "`shared_expert_gate`")
        kr, ke, ks, kg = jr.split(key, 4)
        norm = as_flag(norm_topk_prob, "`norm_topk_prob`")
        if router == "softmax":
            self.gate = eqx.nn.Linear(hidden_size, e, use_bias=False, key=kr, dtype=dtype)
        else:
            self.gate = SigmoidTopKRouter(
                hidden_size,
                e,
                k,
                n_group=n_group,
                topk_group=topk_group,
                norm_topk_prob=norm,
                routed_scaling_factor=routed_scaling_factor,
                key=kr,
            )
        self.experts = SwiGLUExperts(e, hidden_size, intermediate_size, key=ke, dtype=dtype)
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size, key=ks, dtype=dtype)
        self.shared_expert_gate = (
            eqx.nn.Linear(hidden_size, 1, use_bias=False, key=kg, dtype=dtype) if gated else None
        )
        self.top_k = k
        self.norm_topk_prob = norm

    def route(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq experts"], Int[Array, "seq k"], Float[Array, "seq k"]]:
        """The router's decision for each token.

        The logits in the router's dtype (`x` cast to it), the softmax in float32 (float64
        for a float64 router). Ties go to the lower expert id (`jax.lax.top_k`'s rule), so
        exactly equal probabilities choose the same experts on every backend; transformers'
        `torch.topk` promises no order among ties (its CPU kernel's choice among equal
        values even changes with `k`), so on such ties it may choose other experts.

        **Returns:**

        `(probabilities, experts, weights)`: the softmax over all experts, the `top_k`
        chosen experts (most probable first) and their weights (renormalised if
        `norm_topk_prob`, in `x`'s dtype). With the sigmoid router, what it returns (the
        sigmoid scores, the chosen experts and their float32 weights, see
        [`deltanet_cp.nn.SigmoidTopKRouter`][]).
        """
        _check_x(x, self.gate.weight.shape[1])
        if isinstance(self.gate, SigmoidTopKRouter):
            return self.gate(x)
        w = self.gate.weight
        logits = x.astype(w.dtype) @ w.T
        probs = jax.nn.softmax(logits.astype(accumulation_dtype(logits)), axis=-1)
        top, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return probs, experts, top.astype(x.dtype)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        *,
        expert_axis: ExpertAxis = None,
        token_mask: Bool[Array, " seq"] | None = None,
    ) -> tuple[Float[Array, "seq hidden"], RouterStats]:
        """**Arguments:**

        - `x`: one sequence of tokens (this rank's shard of it inside `jax.shard_map`).
        - `expert_axis`: `None`, or the mesh axis (or tuple of axes) inside `jax.shard_map`
            the routed experts are split over, `E / ranks` per rank (see
            [`deltanet_cp.nn.SwiGLUExperts`][] and
            [`deltanet_cp.nn.expert_partition_specs`][]). The tokens must be split over the
            same axes (a context or a data axis, or both): each rank routes its own
            tokens, the tokens of every rank of the axes are gathered, each rank runs its
            experts' pairs and the outputs are summed back onto their ranks. The router
            and the shared expert are whole on every rank.
        - `token_mask`: `None`, or a boolean `(seq,)` array, `True` on the tokens the
            routing statistics count (the real tokens of a packed row, not its padding:
            [`deltanet_cp.data.real_tokens`][]), sharded like `x`. As transformers'
            `load_balancing_loss_func(..., attention_mask)` weights the expert counts and
            router probabilities by the attention mask and divides by its sum, the stats
            then sum over the masked tokens only and `tokens` counts them. Every token is
            still routed and computed: the mask changes the statistics, not `y`. `None`:
            every token counts.

        Each part computes in its parameters' dtype (the router, the routed experts, the
        shared expert and its gate may differ: a checkpoint with float32 experts and
        bfloat16 other tensors), their sum in the dtype that holds them all.

        **Returns:**

        `(y, stats)`: the block's output, `x`'s shape and dtype, and the routing's
        [`deltanet_cp.nn.RouterStats`][] over these tokens (this rank's).

        **Raises:**

        `TypeError` if `expert_axis` is not a name or a tuple of names; `ValueError` for
        `x` not `(seq, hidden)`, a `token_mask` that is not a boolean `(seq,)` array, if
        `expert_axis` names no axis of the enclosing
        `jax.shard_map`, if its ranks times the experts this module holds are not the
        router's experts (with `expert_axis=None`: if this module does not hold every
        expert), or if the experts' weights vary over other mesh axes than `expert_axis`
        (they are split over those).
        """
        expert_axis = _as_expert_axis(expert_axis)
        _check_placement(self.experts, expert_axis, self.gate.weight.shape[0])
        if token_mask is not None:
            check_token_mask(token_mask, x.shape[0])
        probs, experts, weights = self.route(x)
        routed = self.experts._apply(x, experts, weights, expert_axis)
        if isinstance(self.gate, SigmoidTopKRouter):
            # The stats' probabilities: the scores normalised over the experts per token.
            probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        if self.shared_expert_gate is None:
            s = self.shared_expert.down_proj.weight
            shared = jax.vmap(self.shared_expert)(x.astype(s.dtype))
            dtype = _common_dtype(routed.dtype, shared.dtype)
            y = routed.astype(dtype) + shared.astype(dtype)
            return y.astype(x.dtype), _router_stats(probs, experts, token_mask)
        s, g = self.shared_expert.down_proj.weight, self.shared_expert_gate.weight
        shared = jax.vmap(self.shared_expert)(x.astype(s.dtype))
        gate = jax.nn.sigmoid(x.astype(g.dtype) @ g.T)
        dtype = _common_dtype(routed.dtype, shared.dtype, gate.dtype)
        y = routed.astype(dtype) + gate.astype(dtype) * shared.astype(dtype)
        return y.astype(x.dtype), _router_stats(probs, experts, token_mask)


def _router_stats(probs, experts, token_mask) -> RouterStats:
    """The routing's sums over the tokens (those of `token_mask` if given)."""
    counts = jnp.zeros(probs.shape[-1], jnp.float32)
    if token_mask is None:
        return RouterStats(
            counts=counts.at[experts.reshape(-1)].add(1.0),
            probabilities=jnp.sum(probs, axis=0).astype(jnp.float32),
            tokens=jnp.asarray(probs.shape[0], jnp.float32),
        )
    # `where`, not a product: a masked-out token's non-finite probabilities stay out of
    # the sums and their gradients.
    chosen = jnp.repeat(token_mask, experts.shape[-1])
    return RouterStats(
        counts=counts.at[experts.reshape(-1)].add(chosen.astype(jnp.float32)),
        probabilities=jnp.sum(jnp.where(token_mask[:, None], probs, 0), axis=0).astype(jnp.float32),
        tokens=jnp.sum(token_mask, dtype=jnp.float32),
    )


def check_token_mask(token_mask: object, seq: int) -> None:
    """A `ValueError` naming `token_mask` unless it is a boolean `(seq,)` array."""
    dtype = getattr(token_mask, "dtype", None)
    shape = tuple(getattr(token_mask, "shape", ()))
    if dtype != jnp.bool_ or shape != (seq,):
        got = type(token_mask).__name__ if dtype is None else f"{dtype} {shape}"
        raise ValueError(
            f"`token_mask` must be a boolean array (seq,) with seq = {seq}, True on the "
            f"tokens the routing statistics count (this rank's, like the tokens); got {got}. "
            "From packed rows: `deltanet_cp.data.real_tokens(packed)`; from 0/1 values: "
            "`mask.astype(bool)`."
        )


def _check_placement(experts: SwiGLUExperts, expert_axis: ExpertAxis, total: int | None) -> int:
    """The ranks of `expert_axis` (1 if `None`), after checking the experts' placement:
    the mesh axes their weights vary over (inside `jax.shard_map`, those they are split
    over) include `expert_axis`'s, and, given the router's `total` experts, the ranks
    times the experts held are `total`. A `ValueError` naming the fix otherwise."""
    held = experts.num_experts
    split = frozenset().union(
        *(varying_axes(w) for w in (experts.gate_proj, experts.up_proj, experts.down_proj))
    )
    split_names = sorted(split, key=str)
    ranks = 1
    if expert_axis is not None:
        ranks = _axis_size(expert_axis)
        names = (expert_axis,) if isinstance(expert_axis, str) else expert_axis
        missing = [a for a in names if a not in split]
        if split and missing:
            raise ValueError(
                f"`expert_axis={expert_axis!r}`, but the experts' weights are split over the "
                f"mesh axes {split_names} (they vary over those, not over {missing}): pass "
                "`expert_axis` naming the axes of the weights' `in_specs`, or shard the "
                f"weights over {expert_axis!r} (`in_specs` from "
                f"`deltanet_cp.nn.expert_partition_specs(params, {expert_axis!r})`)."
            )
    if total is None or held * ranks == total:
        return ranks
    if expert_axis is None:
        where = (
            f"its weights are split over the mesh axes {split_names}: pass `expert_axis` "
            "naming them (and the tokens split over them too)"
            if split
            else "pass `expert_axis` naming the mesh axes the experts are split over "
            "(inside `jax.shard_map`), or every expert's weights"
        )
        raise ValueError(
            f"The router has {total} experts and this layer holds {held} of them with "
            f"`expert_axis=None`, which runs every expert on every rank: {where}."
        )
    hint = (
        f"{total} experts cannot be split evenly over {ranks} ranks: use an expert "
        f"axis whose size divides {total}"
        if total % ranks
        else f"pass the experts' weights sharded over {expert_axis!r} on their first "
        "dimension (`in_specs` from `deltanet_cp.nn.expert_partition_specs`), "
        f"{total // ranks} per rank"
    )
    raise ValueError(
        f"The router has {total} experts and this rank holds {held}, over the "
        f"{ranks} ranks of `expert_axis={expert_axis!r}`: {hint}."
    )


def expert_partition_specs(tree: PyTree, expert_axis: str | tuple[str, ...]) -> PyTree:
    """The `jax.sharding.PartitionSpec` of every leaf of `tree` for experts split over
    `expert_axis`: `P(expert_axis)` (the first dimension, the experts, sharded) for the
    arrays of every [`deltanet_cp.nn.SwiGLUExperts`][] in `tree` (`P(None, expert_axis)`
    for the experts of stacked layers, a [`deltanet_cp.nn.LayerStack`][], whose
    first dimension is the group), `P()` (replicated) for every other leaf.

    For `jax.shard_map`'s `in_specs` of a model's parameters (and `out_specs` of their
    gradients), and to place them on a mesh so that no device holds every expert
    (`jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))`).

    **Arguments:**

    - `tree`: a model, layer or its parameters (`equinox.partition(model, eqx.is_array)[0]`).
    - `expert_axis`: the mesh axis (or tuple of axes) the experts are split over, as passed
        to the layers and models.

    **Returns:**

    A pytree of `PartitionSpec`s with `tree`'s structure.
    """

    def spec(sub):
        if not isinstance(sub, SwiGLUExperts):
            return jax.tree.map(lambda _: P(), sub)

        # Stacked layers (a model's `LayerStack`) put their group axis first.
        def stacked(x):
            return P(*(None,) * (len(getattr(x, "shape", ())) - 3), expert_axis)

        return jax.tree.map(stacked, sub)

    return jax.tree.map(spec, tree, is_leaf=lambda x: isinstance(x, SwiGLUExperts))

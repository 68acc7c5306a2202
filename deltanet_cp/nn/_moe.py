"""A sparse mixture-of-experts feed-forward layer (Qwen3-Next / Qwen3.5 MoE): a softmax top-k
router, SwiGLU experts run dropless as grouped matmuls, and a gated shared expert."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._validate import as_positive_index
from ._hybrid import SwiGLU


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
        summed over the tokens, float32.
    - `tokens`: how many tokens (routing decisions) the sums are over, float32.
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


def _grouped(x, w, group_sizes):
    """`x[rows of group e] @ w[e].T` for every group `e`: `x` `(m, in)` sorted by group, `w`
    `(groups, out, in)` (torch's layout); `(m, out)`."""
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(x, w, group_sizes, dims)


class SwiGLUExperts(eqx.Module):
    """`E` SwiGLU MLPs, `down_e(silu(gate_e(x)) * up_e(x))`, their weights stacked; each token
    goes through the experts it is routed to.

    Dropless and at the routed FLOPs: the `(token, expert)` pairs are sorted by expert and
    each projection is one grouped matmul (`jax.lax.ragged_dot_general`) over the sorted rows;
    gradients flow to the weights, the tokens and the routing weights (not the choice of
    experts, an integer).
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
    ) -> Float[Array, "seq hidden"]:
        """**Arguments:**

        - `x`: the tokens.
        - `experts`: the experts each token goes to, ids in `[0, E)`.
        - `weights`: the weight of each of those experts' outputs.

        **Returns:**

        $\\sum_j$ `weights[t, j]` $\\cdot$ `expert[experts[t, j]](x[t])` for every token `t`,
        in `x`'s dtype.
        """
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        rows = x[order // k]
        h = jax.nn.silu(_grouped(rows, self.gate_proj, group_sizes)) * _grouped(
            rows, self.up_proj, group_sizes
        )
        out = _grouped(h.astype(x.dtype), self.down_proj, group_sizes).astype(x.dtype)
        out = jnp.zeros_like(out).at[order].set(out, unique_indices=True)
        out = out.reshape(t, k, -1) * weights.astype(x.dtype)[..., None]
        return jnp.sum(out, axis=1)


class SparseMoE(eqx.Module):
    """The sparse mixture-of-experts block of Qwen3-Next and Qwen3.5 MoE.

    Per token: router logits `gate(x)` (`(E,)`, no bias); a softmax over all `E` experts in
    float32; the `top_k` most probable experts, their probabilities renormalised to sum to
    one if `norm_topk_prob`; the routed experts' outputs weighted by them
    ([`deltanet_cp.nn.SwiGLUExperts`][]); plus a shared expert (a SwiGLU MLP) scaled by
    `sigmoid(shared_expert_gate(x))`. What transformers' `Qwen3NextSparseMoeBlock` /
    `Qwen3_5MoeSparseMoeBlock` compute.

    Called on one sequence, `(seq, hidden)`, it also returns the routing's
    [`deltanet_cp.nn.RouterStats`][], for [`deltanet_cp.nn.load_balancing_loss`][].
    """

    gate: eqx.nn.Linear
    experts: SwiGLUExperts
    shared_expert: SwiGLU
    shared_expert_gate: eqx.nn.Linear
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
        - `key`: a PRNG key for the initial parameters.
        - `dtype`: the parameter dtype; the default floating dtype if `None`.

        **Raises:**

        `ValueError` if `top_k` is not in `[1, num_experts]`.
        """
        e = as_positive_index(num_experts, "num_experts")
        k = as_positive_index(top_k, "top_k")
        if k > e:
            raise ValueError(
                f"`top_k` ({k}) is more than the {e} experts: each token is routed to `top_k` "
                f"distinct experts, so pass at most {e}."
            )
        kr, ke, ks, kg = jr.split(key, 4)
        self.gate = eqx.nn.Linear(hidden_size, e, use_bias=False, key=kr, dtype=dtype)
        self.experts = SwiGLUExperts(e, hidden_size, intermediate_size, key=ke, dtype=dtype)
        self.shared_expert = SwiGLU(hidden_size, shared_intermediate_size, key=ks, dtype=dtype)
        self.shared_expert_gate = eqx.nn.Linear(hidden_size, 1, use_bias=False, key=kg, dtype=dtype)
        self.top_k = k
        self.norm_topk_prob = bool(norm_topk_prob)

    def route(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq experts"], Int[Array, "seq k"], Float[Array, "seq k"]]:
        """The router's decision for each token.

        **Returns:**

        `(probabilities, experts, weights)`: the softmax over all experts (float32), the
        `top_k` chosen experts (most probable first) and their weights (renormalised if
        `norm_topk_prob`, in `x`'s dtype).
        """
        logits = x @ self.gate.weight.T
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        top, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return probs, experts, top.astype(logits.dtype)

    def __call__(
        self, x: Float[Array, "seq hidden"]
    ) -> tuple[Float[Array, "seq hidden"], RouterStats]:
        """**Arguments:**

        - `x`: one sequence of tokens.

        **Returns:**

        `(y, stats)`: the block's output, `x`'s shape and dtype, and the routing's
        [`deltanet_cp.nn.RouterStats`][] over these tokens.
        """
        probs, experts, weights = self.route(x)
        routed = self.experts(x, experts, weights)
        shared = jax.vmap(self.shared_expert)(x)
        gate = jax.nn.sigmoid(x @ self.shared_expert_gate.weight.T)
        stats = RouterStats(
            counts=jnp.zeros(probs.shape[-1], jnp.float32).at[experts.reshape(-1)].add(1.0),
            probabilities=jnp.sum(probs, axis=0),
            tokens=jnp.asarray(x.shape[0], jnp.float32),
        )
        return routed + gate * shared, stats

"""Affine maps of the recurrent state and the monoid they form under composition."""

import abc
from typing import TYPE_CHECKING, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


_Map = TypeVar("_Map", bound="AbstractAffineMap")


class AbstractAffineMap(eqx.Module):
    r"""An affine map $h \mapsto M h + U$ of a $(K, V)$ state, with any leading batch axes.

    Affine maps form a monoid under composition: it is associative (so prefixes can be
    taken in log depth with `jax.lax.associative_scan`) but not commutative. Concrete
    subclasses choose how $M$ is stored (dense, diagonal, ...).

    A map may *reset* (per batch row, `resets`): it then forgets its input exactly,
    $h \mapsto U$, which is how a document start acts on the state. Applying, composing and
    taking the adjoint select there instead of multiplying by a zero linear part, so a
    non-finite input is forgotten too (`0 * nan` is `nan`). `resets=None` is a map that
    never resets (and carries nothing more).
    """

    U: eqx.AbstractVar[Float[Array, "*batch k v"]]

    # A field of every concrete map (declared there, after their own, so that their
    # positional order stays `(M, U)`); here for type checkers.
    if TYPE_CHECKING:

        @property
        def resets(self) -> Bool[Array, "*batch"] | None: ...

    def with_resets(self: _Map, resets: Bool[Array, "*batch"] | bool | None) -> _Map:
        """The same map with its `resets` flag replaced (broadcast to the batch shape).

        `None` drops the flag: a map that never resets. The linear part is left as it is,
        so `M` should already be zero where the new flag is true.
        """
        if resets is not None:
            resets = jnp.broadcast_to(jnp.asarray(resets, bool), self.U.shape[:-2])
        return eqx.tree_at(lambda m: m.resets, self, resets, is_leaf=lambda x: x is None)

    @abc.abstractmethod
    def __call__(self, h: Float[Array, "*batch k v"]) -> Float[Array, "*batch k v"]:
        """Apply the map to a state: returns $M h + U$.

        **Arguments:**

        - `h`: a state of shape `(*batch, K, V)`.

        **Returns:**

        The state after the map, of the same shape.
        """

    @abc.abstractmethod
    def then(self, second: "AbstractAffineMap") -> "AbstractAffineMap":
        """Compose two maps. `self` is applied **first**, then `second`.

        `a.then(b)(h) == b(a(h))`.

        **Arguments:**

        - `second`: a map of the same type and shapes, applied after `self`.

        **Returns:**

        The composed map, of the same type and shapes.
        """

    @abc.abstractmethod
    def identity_like(self) -> "AbstractAffineMap":
        """The identity map with the same batch shape, sizes and dtype as `self`."""

    @abc.abstractmethod
    def adjoint(self, offset: Float[Array, "*batch k v"]) -> "AbstractAffineMap":
        r"""The map $\lambda \mapsto M^\top \lambda + \text{offset}$, of the same kind.

        What carries a cotangent backwards through this map: if $h' = M h + U$ and the
        loss asks $\lambda$ of $h'$ and `offset` of $h$ directly, it asks
        $M^\top \lambda + \text{offset}$ of $h$.
        """


class AffineMap(AbstractAffineMap):
    r"""A dense affine map $h \mapsto M h + U$ with $M$ a $K \times K$ matrix.

    This is how one chunk (or one rank's whole shard) of the gated delta rule acts on the
    incoming state: $M = \gamma I - \tilde k^\top w$, $U = \tilde k^\top u$.

    **Arguments:**

    - `M`: the linear part, shape `(*batch, K, K)`.
    - `U`: the offset, shape `(*batch, K, V)`.
    - `resets`: optionally, per batch row, whether the map forgets its input ($h \mapsto U$
        exactly, whatever `M` holds); `None` for a map that never resets.
    """

    M: Float[Array, "*batch k k"]
    U: Float[Array, "*batch k v"]
    resets: Bool[Array, "*batch"] | None = None  # pyright: ignore[reportIncompatibleMethodOverride]

    def __check_init__(self):
        if self.M.shape[:-2] != self.U.shape[:-2] or self.M.shape[-1] != self.U.shape[-2]:
            raise ValueError(
                f"AffineMap needs M of shape (*batch, K, K) and U of shape (*batch, K, V); "
                f"got M {self.M.shape} and U {self.U.shape}."
            )
        if self.M.shape[-1] != self.M.shape[-2]:
            raise ValueError(f"AffineMap needs a square M, got shape {self.M.shape}.")
        _check_resets(self)

    @classmethod
    def identity(
        cls,
        k: int,
        v: int,
        batch_shape: tuple[int, ...] = (),
        dtype=jnp.float32,
    ) -> "AffineMap":
        """The identity map $(I, 0)$.

        **Arguments:**

        - `k`: the state's key size $K$.
        - `v`: the state's value size $V$.
        - `batch_shape`: leading batch axes.
        - `dtype`: the dtype of `M` and `U`.

        **Returns:**

        An `AffineMap` with `M = I` and `U = 0`.
        """
        eye = jnp.broadcast_to(jnp.eye(k, dtype=dtype), (*batch_shape, k, k))
        return cls(eye, jnp.zeros((*batch_shape, k, v), dtype))

    def __call__(self, h: Float[Array, "*batch k v"]) -> Float[Array, "*batch k v"]:
        """Apply the map to a state: returns $M h + U$ ($U$ where the map resets)."""
        return _unless_reset(self.resets, self.U, _matmul(self.M, h) + self.U)

    def then(self, second: AbstractAffineMap) -> "AffineMap":
        r"""Compose two maps. `self` is applied **first**, then `second`.

        `a.then(b)(h) == b(a(h))`; the result is $(M_b M_a,\ M_b U_a + U_b)$, or `b`
        itself where `b` resets, and it resets where either does.
        """
        second = _same_kind(self, second)
        m = _unless_reset(second.resets, second.M, _matmul(second.M, self.M))
        u = _unless_reset(second.resets, second.U, _matmul(second.M, self.U) + second.U)
        return AffineMap(m, u, _either(self.resets, second.resets))

    def identity_like(self) -> "AffineMap":
        """The identity map $(I, 0)$ with the same batch shape, sizes and dtype as `self`
        (and a `resets` flag, all false, if `self` has one)."""
        eye = jnp.eye(self.M.shape[-1], dtype=self.M.dtype)
        resets = None if self.resets is None else jnp.zeros_like(self.resets)
        return AffineMap(jnp.broadcast_to(eye, self.M.shape), jnp.zeros_like(self.U), resets)

    def adjoint(self, offset: Float[Array, "*batch k v"]) -> "AffineMap":
        r"""The map $\lambda \mapsto M^\top \lambda + \text{offset}$ (`offset` alone where
        `self` resets: what leaves a resetting map asks nothing of what entered it)."""
        return AffineMap(jnp.swapaxes(self.M, -1, -2), offset, self.resets)


class DiagonalAffineMap(AbstractAffineMap):
    r"""An affine map $h \mapsto \mathrm{diag}(d)\, h + U$ whose linear part is diagonal.

    This is how a chunk of a recurrence without a delta term acts on the state (gated
    linear attention, Mamba-2, RetNet): row $i$ of the state is only ever scaled by
    `decay[i]`. Storing the diagonal instead of a dense $K \times K$ matrix makes one map
    $K + K V$ numbers instead of $K (K + V)$, which is what context parallelism exchanges.
    A scalar decay per head is the same map with `decay` constant over $K$.

    **Arguments:**

    - `decay`: the diagonal of the linear part, shape `(*batch, K)`.
    - `U`: the offset, shape `(*batch, K, V)`.
    - `resets`: optionally, per batch row, whether the map forgets its input ($h \mapsto U$
        exactly, whatever `decay` holds); `None` for a map that never resets.
    """

    decay: Float[Array, "*batch k"]
    U: Float[Array, "*batch k v"]
    resets: Bool[Array, "*batch"] | None = None  # pyright: ignore[reportIncompatibleMethodOverride]

    def __check_init__(self):
        if self.decay.shape != self.U.shape[:-1]:
            raise ValueError(
                f"DiagonalAffineMap needs decay of shape (*batch, K) and U of shape "
                f"(*batch, K, V); got decay {self.decay.shape} and U {self.U.shape}."
            )
        _check_resets(self)

    @classmethod
    def identity(
        cls,
        k: int,
        v: int,
        batch_shape: tuple[int, ...] = (),
        dtype=jnp.float32,
    ) -> "DiagonalAffineMap":
        """The identity map (`decay = 1`, `U = 0`).

        **Arguments:**

        - `k`: the state's key size $K$.
        - `v`: the state's value size $V$.
        - `batch_shape`: leading batch axes.
        - `dtype`: the dtype of `decay` and `U`.

        **Returns:**

        A `DiagonalAffineMap` with `decay = 1` and `U = 0`.
        """
        return cls(jnp.ones((*batch_shape, k), dtype), jnp.zeros((*batch_shape, k, v), dtype))

    def __call__(self, h: Float[Array, "*batch k v"]) -> Float[Array, "*batch k v"]:
        r"""Apply the map to a state: returns $\mathrm{diag}(d)\, h + U$ ($U$ where the map
        resets)."""
        return _unless_reset(self.resets, self.U, self.decay[..., None] * h + self.U)

    def then(self, second: AbstractAffineMap) -> "DiagonalAffineMap":
        r"""Compose two maps. `self` is applied **first**, then `second`.

        `a.then(b)(h) == b(a(h))`; the result is $(d_b d_a,\ \mathrm{diag}(d_b) U_a + U_b)$.
        Diagonal maps commute in their linear parts, but the offsets still make the
        composition order matter. Where `b` resets the result is `b` itself, and it resets
        where either does.
        """
        second = _same_kind(self, second)
        d = _unless_reset(second.resets, second.decay, second.decay * self.decay)
        u = _unless_reset(second.resets, second.U, second.decay[..., None] * self.U + second.U)
        return DiagonalAffineMap(d, u, _either(self.resets, second.resets))

    def identity_like(self) -> "DiagonalAffineMap":
        """The identity map (`decay = 1`, `U = 0`) with the same shapes and dtype as `self`
        (and a `resets` flag, all false, if `self` has one)."""
        resets = None if self.resets is None else jnp.zeros_like(self.resets)
        return DiagonalAffineMap(jnp.ones_like(self.decay), jnp.zeros_like(self.U), resets)

    def adjoint(self, offset: Float[Array, "*batch k v"]) -> "DiagonalAffineMap":
        r"""The map $\lambda \mapsto \mathrm{diag}(d) \lambda + \text{offset}$ (`offset` alone
        where `self` resets)."""
        return DiagonalAffineMap(self.decay, offset, self.resets)


def _same_kind(first: _Map, second: AbstractAffineMap) -> _Map:
    if type(second) is not type(first):
        raise TypeError(
            f"Can only compose affine maps of the same kind: {type(first).__name__} then "
            f"{type(second).__name__}."
        )
    return second  # pyright: ignore[reportReturnType]


def _check_resets(m: AbstractAffineMap) -> None:
    if m.resets is not None and m.resets.shape != m.U.shape[:-2]:
        raise ValueError(
            f"{type(m).__name__} needs `resets` of the batch shape {m.U.shape[:-2]}; got "
            f"{m.resets.shape}."
        )


def _unless_reset(resets, on_reset, value):
    """`value`, but `on_reset` (selected, not multiplied) in the batch rows that reset."""
    if resets is None:
        return value
    flag = resets.reshape(resets.shape + (1,) * (value.ndim - resets.ndim))
    return jnp.where(flag, on_reset, value)


def _either(a, b):
    """The `resets` of a composition: where either map resets (`None` if neither can)."""
    if a is None:
        return b
    if b is None:
        return a
    return a | b


def _matmul(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def prefix_scan(maps: _Map, *, exclusive: bool = False) -> _Map:
    """Prefix compositions of maps stacked along their leading axis.

    Uses `jax.lax.associative_scan`, so the depth is logarithmic in the number of maps.

    **Arguments:**

    - `maps`: an affine map whose arrays have a leading axis of length `n`; element `i`
        is applied before element `i + 1`.
    - `exclusive`: if `False`, element `i` of the result is `maps[0]` then ... then
        `maps[i]`. If `True`, it is the composition of `maps[0..i-1]` (the identity for
        `i = 0`): the map that takes the initial state to the state entering element `i`.

    **Returns:**

    An affine map of the same type and shape as `maps`.
    """
    inclusive = jax.lax.associative_scan(lambda a, b: a.then(b), maps, axis=0)
    if not exclusive:
        return inclusive
    first = jax.tree.map(lambda x: x[:1], maps).identity_like()
    return jax.tree.map(lambda i, x: jnp.concatenate([i, x[:-1]], axis=0), first, inclusive)

"""State checkpoints as an output of the engine's pass: a recurrence wrapped to run in chunks
of `every` tokens that also emits the state after each of them.

Built on the public recurrence interface only ([`deltanet_cp.AbstractRecurrence`][]), so
[`deltanet_cp.run`][] runs it like any other recurrence, context parallel and zigzag
included: the checkpoints come out of the same pass (phase 3 under context parallelism) and
cost no collective. A chunk of `every` tokens is `every / C` chunks of the inner recurrence:
`prepare` forms their factors batched as the inner recurrence would, `step` walks them (the
same sequential work), `compose` composes them.

The state after a chunk (`HV * K * V` numbers) leaves `step` as an output spread over the
chunk's `every` positions, `ceil(HV K V / every)` numbers a position, and
[`checkpoints`][deltanet_cp.nn._checkpointed.checkpoints] folds them back.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PyTree

from .._affine import AbstractAffineMap
from .._recurrence import AbstractRecurrence


class Checkpointed(AbstractRecurrence):
    """`inner` in chunks of `chunk_size` tokens (a multiple of `inner.chunk_size`), emitting
    `(inner outputs, the state after each chunk spread over its positions)`."""

    inner: AbstractRecurrence = eqx.field(static=True)
    chunk_size: int = eqx.field(static=True)

    def __check_init__(self):
        if self.chunk_size % self.inner.chunk_size:
            raise ValueError(
                f"checkpoint_every ({self.chunk_size}) must be a multiple of the recurrence's "
                f"chunk size ({self.inner.chunk_size})."
            )

    @property
    def _sub(self) -> int:
        return self.chunk_size // self.inner.chunk_size

    def check(self, inputs) -> None:
        self.inner.check(inputs)

    def state(self, inputs) -> jax.ShapeDtypeStruct:
        return self.inner.state(inputs)

    def prepare(self, chunks):
        c, m = self.inner.chunk_size, self._sub

        def split(x):  # (B, N, L, ...) -> (B, N m, C, ...)
            return x.reshape(x.shape[0], x.shape[1] * m, c, *x.shape[3:])

        factors = self.inner.prepare(jax.tree.map(split, chunks))
        return jax.tree.map(lambda f: f.reshape(-1, m, *f.shape[1:]), factors)

    def step(self, factors, h: Array) -> tuple[Array, PyTree]:
        h_next, outs = jax.lax.scan(lambda h, f: self.inner.step(f, h), h, factors)

        def merge(y):  # (m, B, C, ...) -> (B, m C, ...)
            y = jnp.moveaxis(y, 0, 1)
            return y.reshape(y.shape[0], -1, *y.shape[3:])

        width = math.ceil(math.prod(h.shape[1:]) / self.chunk_size)
        flat = h_next.reshape(h.shape[0], -1)
        flat = jnp.pad(flat, ((0, 0), (0, width * self.chunk_size - flat.shape[1])))
        return h_next, (jax.tree.map(merge, outs), flat.reshape(h.shape[0], self.chunk_size, width))

    def chunk_map(self, factors) -> AbstractAffineMap:
        first = self.inner.chunk_map(jax.tree.map(lambda f: f[0], factors))
        return self._compose(jax.tree.map(lambda f: f[1:], factors), first)

    def compose(self, factors, running: AbstractAffineMap) -> AbstractAffineMap:
        return self._compose(factors, running)

    def _compose(self, factors, running):
        running, _ = jax.lax.scan(lambda r, f: (self.inner.compose(f, r), None), running, factors)
        return running

    def finalize(self, outputs: PyTree, inputs) -> PyTree:
        outs, states = outputs
        return self.inner.finalize(outs, inputs), states


def checkpoints(states: Array, every: int, shape: tuple[int, ...]) -> Array:
    """The states after every complete chunk of `every` tokens, `(B, n, *shape)`, from the
    spread states `(B, T, width)` that [`Checkpointed`][] emits (`n = T // every`)."""
    b, t, width = states.shape
    n = t // every
    flat = states[:, : n * every].reshape(b, n, every * width)
    return flat[..., : math.prod(shape)].reshape(b, n, *shape)

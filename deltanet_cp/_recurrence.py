"""The interface a recurrence implements for the engine: `AbstractRecurrence`."""

import abc
from typing import Generic, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from ._affine import AbstractAffineMap


_Inputs = TypeVar("_Inputs")
_Factors = TypeVar("_Factors")
_Map = TypeVar("_Map", bound=AbstractAffineMap)


class AbstractRecurrence(eqx.Module, Generic[_Inputs, _Factors, _Map]):
    r"""A linear recurrence whose chunks act on the state as affine maps $h \mapsto M h + U$.

    An instance is a static configuration (chunk size and the like); it holds no data.
    [`deltanet_cp.run`][] hands it the inputs, a PyTree whose array leaves all have the
    batch on axis 0 and time on axis 1. Every method below is one the engine calls:

    - `state(inputs)`: the shape and dtype of the recurrent state;
    - `prepare(chunks)`: everything that does not depend on the incoming state, batched
        over a block of chunks (chunk-parallel, outside the sequential path);
    - `step(factors, h)`: one chunk, from its incoming state to its outgoing state and
        outputs: the state recursion, the only part that walks the chunks one by one;
    - `chunk_map(factors)`: one chunk as an explicit affine map (context parallelism);
    - `compose(factors, running)`: a chunk appended to a running map; the default forms
        `chunk_map`, a recurrence overrides it where a cheaper form exists;
    - `finalize(outputs, inputs)`: the assembled outputs in the public layout;
    - `check(inputs)`: optional input validation (the default checks nothing);
    - `factor_cotangents(factors, states, d_next, d_outputs)`: the cotangents `step` sends
        to a block's factors; the default differentiates `step`, a recurrence overrides
        it with the products written out.

    The engine differentiates the passes by hand: it keeps the state entering each block,
    and in the backward forms each block's factors again, walks the block's chunks forward
    once more for the state entering each (the state recursion only, no outputs), walks
    them in reverse carrying only the state's cotangent (`step`'s VJP in `h`), and then
    forms every factor's cotangent batched over the block (`factor_cotangents`) and pulls
    it back through `prepare`. So `step` must be affine in `h`; what it does with the
    factors is free.

    The engine pads the time axis with zeros to whole chunks: a token whose inputs are all
    zero must leave the state unchanged.
    """

    chunk_size: eqx.AbstractVar[int]

    def __check_init__(self):
        c = self.chunk_size
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise ValueError(f"`chunk_size` must be a positive int; got {c!r}.")

    def check(self, inputs: _Inputs) -> None:
        """Raise a `ValueError` that names the problem if `inputs` don't fit together."""

    @abc.abstractmethod
    def state(self, inputs: _Inputs) -> jax.ShapeDtypeStruct:
        """The shape and dtype of the recurrent state, e.g. `(B, HV, K, V)` in float32.

        The last two axes are the `(K, V)` that affine maps act on; the first is the batch.
        """

    @abc.abstractmethod
    def prepare(self, chunks: _Inputs) -> _Factors:
        """Per-chunk factors that do not depend on the incoming state, for many chunks.

        **Arguments:**

        - `chunks`: a block of the inputs: every array leaf's time axis zero-padded to
            whole chunks and split, `(B, T, *rest)` becoming `(B, N, C, *rest)` with `N`
            the chunks of the block.

        **Returns:**

        A PyTree whose every leaf has the chunk index as its leading axis (`N`).
        """

    @abc.abstractmethod
    def step(self, factors: _Factors, h: Array) -> tuple[Array, PyTree]:
        """Advance the state over one chunk and emit the chunk's outputs.

        Affine in `h`. Keep it to the state recursion: everything that does not need `h`
        belongs in `prepare`, which runs batched over chunks.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.
        - `h`: the state entering the chunk.

        **Returns:**

        `(h_next, outputs)`, the outputs a PyTree of arrays with the batch on axis 0 and
        the chunk's `C` positions on axis 1.
        """

    @abc.abstractmethod
    def chunk_map(self, factors: _Factors) -> _Map:
        r"""One chunk as an explicit affine map of the incoming state.

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.

        **Returns:**

        The map $h \mapsto M h + U$ with `chunk_map(factors)(h) == step(factors, h)[0]`.
        """

    def compose(self, factors: _Factors, running: _Map) -> _Map:
        """Append one chunk to a running map: `running.then(chunk_map(factors))`.

        Override it where the chunk's structure avoids forming the dense chunk map (a
        low-rank update, a diagonal).

        **Arguments:**

        - `factors`: one chunk's slice of `prepare(chunks)`.
        - `running`: the map of the chunks before it.

        **Returns:**

        The map of the chunks before it and this one, of the same type as `running`.
        """
        return running.then(self.chunk_map(factors))  # pyright: ignore[reportReturnType]

    def factor_cotangents(
        self, factors: _Factors, states: Array, d_next: Array, d_outputs: PyTree
    ) -> _Factors:
        """The cotangents of a block's factors from `step`, batched over the block's chunks.

        The default is `step`'s VJP in its factors, mapped over the chunks; override it
        where the products can be written as a few batched matmuls.

        **Arguments:**

        - `factors`: a block's factors, as `prepare` returned them (chunk axis first).
        - `states`: the state entering each chunk, `(N, *state)`.
        - `d_next`: the cotangent of the state leaving each chunk, `(N, *state)`.
        - `d_outputs`: the cotangents of each chunk's outputs (chunk axis first).

        **Returns:**

        The cotangents of `factors`, of the same structure.
        """

        def one(f, h, d_h, d_out):
            _, pull = jax.vjp(lambda f: self.step(f, h), f)
            return pull((d_h, d_out))[0]

        return jax.vmap(one)(factors, states, d_next, d_outputs)

    @abc.abstractmethod
    def finalize(self, outputs: PyTree, inputs: _Inputs) -> PyTree:
        """Turn the assembled outputs of `step` into the public outputs (their dtype, say).

        **Arguments:**

        - `outputs`: the outputs of `step` for every token, time on axis 1, in token
            order (padding cut, packed documents put back).
        - `inputs`: the inputs, as handed to [`deltanet_cp.run`][].

        **Returns:**

        The public outputs.
        """

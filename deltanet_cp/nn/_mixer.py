"""The one call shape of every token mixer of `deltanet_cp.nn` (the recurrent layers,
RWKV-7's time mix and attention), so the blocks and decoder layers that hold them never
switch on their type."""

import abc
from typing import Any

import equinox as eqx
from jaxtyping import Array, Float, Int

from .._custom_types import CuSeqlens
from .._options import EngineOptions
from .._parallel import ContextParallel
from .._precision import PrecisionName
from .._run import Memory
from ._schedule import KVSchedule


class AbstractTokenMixer(eqx.Module):
    """A token mixer: a layer that mixes information across the tokens of one sequence.

    Every token mixer of `deltanet_cp.nn` (the recurrent layers, RWKV-7's time mix,
    attention) takes the same call, so a block holding any of them calls it one way:

    ```python
    y = mixer(x, state, cp=cp, cu_seqlens=cu_seqlens, kv_schedule=kv_schedule, v_first=v_first)
    y, state = mixer.step(x_t, state, position)
    ```

    The keywords only some mixers read are accepted and ignored by the others:
    `kv_schedule` (how attention exchanges keys and values under context parallelism; a
    recurrent layer's exchange is its `cp`'s) and `v_first` (the values of a model's first
    RWKV-7 layer, for the later ones; see `first_values`). `position` (the token's
    position) is read by attention's `step` only: its cache does not count the tokens.
    """

    @abc.abstractmethod
    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        state: Any = None,
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The output `(seq, hidden)` of one sequence `x: (seq, hidden)`."""

    @abc.abstractmethod
    def init_state(self, dtype=None, *, capacity: int | None = None) -> Any:
        """The state before the first token (attention: an empty cache of `capacity`
        tokens; the recurrent mixers need no capacity and ignore it)."""

    @abc.abstractmethod
    def step(
        self,
        x: Float[Array, " hidden"],
        state: Any,
        position: Int[Array, ""] | int | None = None,
        /,
        *,
        v_first: Float[Array, "heads v"] | None = None,
    ) -> tuple[Float[Array, " hidden"], Any]:
        """One token of generation: `(y, new_state)`."""

    def extend(
        self,
        x: Float[Array, "seq hidden"],
        state: Any,
        position: Int[Array, ""] | int,
        /,
        *,
        cp: ContextParallel | None = None,
        kv_schedule: KVSchedule = "allgather",
        v_first: Float[Array, "seq heads v"] | None = None,
        checkpoint_every: int | None = None,
    ) -> tuple[Float[Array, "seq hidden"], Any, Any]:
        """A prompt's next tokens `x`, continuing from `state`, which holds the sequence's
        first `position` tokens: `(y, new_state, checkpoints)`, the one prefill call of every
        mixer (a decoder layer calls it one way whatever its mixer).

        A recurrent mixer's state continues by itself (`position` is ignored) and, with
        `checkpoint_every`, `checkpoints` holds its states at those boundaries, as its
        `prefill` returns them; attention writes `x`'s keys and values after the cache's
        first `position` entries and returns `checkpoints = None` (the keys and values of
        any prefix are already the cache's first entries).

        **Raises:**

        `TypeError` for a mixer that has no prefill.
        """
        del x, state, position, cp, kv_schedule, v_first, checkpoint_every
        raise TypeError(f"{type(self).__name__} has no prefill: it cannot continue a prompt.")

    def first_values(
        self,
        x: Float[Array, "seq hidden"],
        *,
        cp: ContextParallel | None = None,
        cu_seqlens: CuSeqlens | None = None,
    ) -> Float[Array, "seq heads v"] | None:
        """What this mixer hands the later mixers of its model as `v_first`, from its
        input `x`: `None` for every mixer but a model's first RWKV-7 layer (its `values`)."""
        del x, cp, cu_seqlens
        return None


class AbstractEngineMixer(AbstractTokenMixer):
    """A token mixer whose recurrence runs through the engine: it holds one static
    [`deltanet_cp.EngineOptions`][] `options`, and reads its four settings through the
    properties `chunk_size`, `block_size`, `memory` and `precision`."""

    options: eqx.AbstractVar[EngineOptions]

    @property
    def chunk_size(self) -> int:
        """`options.chunk_size`: tokens per chunk of the recurrence."""
        return self.options.chunk_size

    @property
    def block_size(self) -> int | None:
        """`options.block_size`: the engine's block (`None`: the backend's default)."""
        return self.options.block_size

    @property
    def memory(self) -> Memory | None:
        """`options.memory`: what the engine's backward keeps."""
        return self.options.memory

    @property
    def precision(self) -> PrecisionName | None:
        """`options.precision`: how the recurrence's large products multiply."""
        return self.options.precision

"""The decode cache of the Qwen3.5 model and its state checkpoints: their types, the check
that a cache fits a model, and the cache of a checkpointed prefix."""

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._precision import accumulation_dtype
from ..nn._attention import KVCache
from ..nn._delta_layer import RecurrentLayerState
from ..nn._latent_attention import LatentKVCache
from ._config import AbstractQwenTextConfig, KimiLinearConfig


@runtime_checkable
class _Layers(Protocol):
    """A model's layers as the cache reads them: a tuple, or a stack that reads as one."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def __getitem__(self, i: int, /) -> Any: ...


@runtime_checkable
class _CachedModel(Protocol):
    """What the cache checks read of a model (a `Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`,
    `Qwen3_5MoeForCausalLM` or `KimiLinearForCausalLM`)."""

    @property
    def config(self) -> AbstractQwenTextConfig | KimiLinearConfig: ...

    @property
    def layers(self) -> _Layers: ...

    def init_cache(self, capacity: int, dtype: Any = None) -> "Qwen3_5Cache": ...


def concrete(x: Any) -> Any:
    """`x` as a NumPy value if it is known now (not traced), else `None`."""
    try:
        return np.asarray(x)
    except jax.errors.TracerArrayConversionError:
        return None


def _describe(tree: Any) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", tree))


class Qwen3_5Cache(eqx.Module):
    """What [`deltanet_cp.models.Qwen3_5ForCausalLM`][] (and the mixture-of-experts
    [`deltanet_cp.models.Qwen3NextForCausalLM`][] and
    [`deltanet_cp.models.Qwen3_5MoeForCausalLM`][]) carries from a prefill to the next
    token.

    **Fields:**

    - `layers`: per layer, a [`deltanet_cp.nn.RecurrentLayerState`][] (the Gated DeltaNet
        and Kimi Delta Attention layers' conv and recurrent states), a
        [`deltanet_cp.nn.KVCache`][] (the attention layers' keys and values, with room for
        `capacity` tokens) or a [`deltanet_cp.nn.LatentKVCache`][] (the latent attention
        layers' compressed keys and values).
    - `length`: how many tokens the model has seen (the position of the next one).
    """

    layers: tuple[RecurrentLayerState | KVCache | LatentKVCache, ...]
    length: Int[Array, ""]

    @property
    def capacity(self) -> int:
        """The most tokens the attention layers' caches hold."""
        for c in self.layers:
            if isinstance(c, KVCache):
                return c.k.shape[-3]
            if isinstance(c, LatentKVCache):
                return c.latent.shape[-2]
        return jnp.iinfo(jnp.int32).max


class Qwen3_5Checkpoints(eqx.Module):
    """The Gated DeltaNet layers' states at fixed token boundaries of a prefill.

    **Fields:**

    - `layers`: per layer, a [`deltanet_cp.nn.RecurrentLayerState`][] with a leading axis
        over the checkpoints (`None` for the attention layers, whose keys and values for
        any prefix are the cache's first entries).
    - `lengths`: `(n,)`, how many tokens the model had seen at each checkpoint.

    [`deltanet_cp.models.Qwen3_5ForCausalLM.restore`][] turns one checkpoint and the
    prefill's cache into the cache of that prefix.
    """

    layers: tuple[RecurrentLayerState | None, ...]
    lengths: Int[Array, " n"]


def check_cache(model: _CachedModel, cache: Any, name: str = "cache") -> None:
    """A `ValueError` naming `name` and what differs if `cache` is not a cache of this
    model (its layers, their kinds, shapes and dtypes)."""
    if not isinstance(cache, Qwen3_5Cache):
        raise ValueError(
            f"`{name}` must be a Qwen3_5Cache (from `init_cache`, `prefill` or "
            f"`decode_step`); got {type(cache).__name__}."
        )
    length = cache.length
    if (
        not (hasattr(length, "dtype") and jnp.issubdtype(length.dtype, jnp.integer))
        or jnp.ndim(length) != 0
    ):
        raise ValueError(
            f"`{name}.length` must be a 0-d integer array (one sequence: `jax.vmap` over "
            f"a batch of caches); got {getattr(length, 'shape', length)!r}."
        )
    kinds = model.config.layer_types
    if len(cache.layers) != len(model.layers):
        raise ValueError(
            f"`{name}` has {len(cache.layers)} layers; this model has {len(model.layers)} "
            f"({', '.join(kinds)}). Was it made by another model? Make it with this "
            "model's `init_cache` or `prefill`."
        )
    capacities = {c.k.shape[0] for c in cache.layers if isinstance(c, KVCache)} | {
        c.latent.shape[0] for c in cache.layers if isinstance(c, LatentKVCache)
    }
    capacity = capacities.pop() if len(capacities) == 1 else 1
    if capacities:
        raise ValueError(
            f"The attention layers of `{name}` hold different numbers of tokens "
            f"({sorted(capacities | {capacity})}); make it with this model's `init_cache`."
        )
    want = jax.eval_shape(lambda: model.init_cache(capacity))
    for i, (got, expected, kind) in enumerate(zip(cache.layers, want.layers, kinds)):
        if type(got) is not type(expected):
            raise ValueError(
                f"Layer {i} of this model is {kind!r} and takes a "
                f"{type(expected).__name__}; `{name}.layers[{i}]` is a "
                f"{type(got).__name__}. Was the cache made by another model?"
            )
        shapes = [tuple(getattr(a, "shape", ())) for a in jax.tree.leaves(got)]
        if shapes != [a.shape for a in jax.tree.leaves(expected)] or not all(
            jnp.issubdtype(a.dtype, jnp.floating) for a in jax.tree.leaves(got)
        ):
            raise ValueError(
                f"`{name}.layers[{i}]` ({kind}) is {_describe(got)}; this model's is "
                f"{_describe(expected)} (floating-point, any dtype). Was the cache made "
                "by another config, or does it carry a batch axis (`jax.vmap` over it)?"
            )
        if isinstance(got, RecurrentLayerState):
            rdt = accumulation_dtype(got.conv)
            if got.recurrent.dtype != rdt:
                raise ValueError(
                    f"`{name}.layers[{i}].recurrent` has dtype {got.recurrent.dtype}; the "
                    f"recurrent states are {jnp.dtype(rdt)} (see `init_cache`)."
                )


def restore(
    model: _CachedModel,
    cache: Qwen3_5Cache,
    checkpoints: Qwen3_5Checkpoints,
    index: Int[Array, ""] | int,
) -> Qwen3_5Cache:
    """[`deltanet_cp.models.Qwen3_5ForCausalLM.restore`][], for `model`."""
    check_cache(model, cache)
    if not isinstance(checkpoints, Qwen3_5Checkpoints) or len(checkpoints.layers) != len(
        model.layers
    ):
        raise ValueError(
            "`checkpoints` must be the Qwen3_5Checkpoints of this model's `prefill(..., "
            f"checkpoint_every=L)`, one entry per layer ({len(model.layers)})."
        )
    lengths = checkpoints.lengths
    n = lengths.shape[0] if jnp.ndim(lengths) == 1 else -1
    for i, (state, saved) in enumerate(zip(cache.layers, checkpoints.layers)):
        if isinstance(state, (KVCache, LatentKVCache)) != (saved is None) or (
            saved is not None
            and [a.shape for a in jax.tree.leaves(saved)]
            != [(n, *a.shape) for a in jax.tree.leaves(state)]
        ):
            raise ValueError(
                f"`checkpoints.layers[{i}]` does not fit layer {i} of this model "
                f"({model.config.layer_types[i]}): expected "
                f"{'None' if saved is None else f'{n} states like the cache'}. Were the "
                "checkpoints made by another model?"
            )
    if n <= 0:
        raise ValueError("`checkpoints` holds no checkpoint (`lengths` is empty).")
    known = concrete(lengths)
    available = (
        f"{n} checkpoint(s), index 0 to {n - 1}"
        if known is None
        else f"{n} checkpoint(s): "
        + ", ".join(f"{j} (after {int(e)} tokens)" for j, e in enumerate(known))
    )
    if (
        isinstance(index, (bool, np.bool_))
        or not (
            isinstance(index, (int, np.integer))
            or (hasattr(index, "dtype") and jnp.issubdtype(index.dtype, jnp.integer))
        )
        or jnp.ndim(index) != 0
    ):
        raise ValueError(f"`index` must be an int, one of {available}; got {index!r}.")
    at = concrete(index)
    if at is not None:
        at = int(at)
        if not 0 <= at < n:
            raise ValueError(f"`index` {at} is not a checkpoint; there are {available}.")
        index = at
    else:
        index = eqx.error_if(
            index, (index < 0) | (index >= n), f"`index` must be one of {available}."
        )
    end = lengths[index]
    seen = concrete(cache.length)
    if seen is not None and known is not None and int(seen) < int(end):
        raise ValueError(
            f"`cache` has seen {int(seen)} tokens, fewer than checkpoint {index}'s "
            f"{int(end)}: pass a cache of the same sequence at or past the checkpoint."
        )
    end = eqx.error_if(
        end,
        cache.length < end,
        "`cache` has seen fewer tokens than the checkpoint: pass a cache of the same "
        "sequence at or past it.",
    )
    layers = tuple(
        c if saved is None else jax.tree.map(lambda a: a[index], saved)
        for c, saved in zip(cache.layers, checkpoints.layers)
    )
    return Qwen3_5Cache(layers, end)

"""Token ids into a language model: one check of their type, shape and range, shared by
[`deltanet_cp.nn.HybridLM`][] and [`deltanet_cp.models.Qwen3_5ForCausalLM`][]."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from .._sharding import varying_axes


def check_tokens(tokens, vocab: int, name: str = "tokens", *, ndim: int = 1) -> Int[Array, "..."]:
    """`tokens` as a JAX integer array of ids in `[0, vocab)`.

    An embedding lookup silently clamps an id outside the vocabulary (`vocab` reads as
    `vocab - 1`, `-1` wraps), so the ids are checked: concrete ones with a `ValueError` that
    names the first bad id and its position; traced ones (under `jax.jit`, `jax.vmap`,
    `jax.shard_map`) through `equinox.error_if`, which fails the computation when it runs.
    Inside `shard_map` the verdict is reduced over every mesh axis the tokens vary over, so
    that all ranks fail together (a rank that failed alone would leave the others waiting in
    their next collective).

    **Arguments:**

    - `tokens`: the ids: a 1-D integer array (`ndim=1`), or a scalar id (`ndim=0`, a
        Python int accepted).
    - `vocab`: the vocabulary size.
    - `name`: the argument's name, for the messages.
    - `ndim`: 1 for a sequence, 0 for one token.

    **Raises:**

    `ValueError` naming `name` if `tokens` is not an integer array of `ndim` dimensions or
    (when concrete) holds an id outside `[0, vocab)`.
    """
    if ndim == 0 and isinstance(tokens, (int, np.integer)) and not isinstance(tokens, bool):
        # Checked as a Python value: under `jax.jit` an array made of it would be traced.
        tokens = np.asarray(tokens, np.int64 if abs(int(tokens)) >= 2**31 else np.int32)
    dtype = getattr(tokens, "dtype", None)
    if (
        dtype is None
        or not jnp.issubdtype(dtype, jnp.integer)
        or getattr(tokens, "ndim", None) != ndim
    ):
        what = (
            "a 1-D integer array of token ids, one sequence (`jax.vmap` the model over a batch)"
            if ndim == 1
            else "one token id: an int or a 0-d integer array (`jax.vmap` over a batch)"
        )
        raise ValueError(
            f"`{name}` must be {what}; got {getattr(tokens, 'shape', type(tokens).__name__)}"
            f"{'' if dtype is None else f' of dtype {dtype}'}."
        )
    message = f"`{name}` must be ids in [0, vocab_size = {vocab})"
    try:
        values = np.asarray(tokens)
    except jax.errors.TracerArrayConversionError:
        values = None
    if values is not None:
        bad = np.argwhere((values < 0) | (values >= vocab))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            where = f" at position {at[0]}" if ndim == 1 else ""
            raise ValueError(
                f"{message}; got {int(values[at])}{where} ({len(bad)} id(s) out of range). An "
                "embedding lookup would silently clamp it: fix the ids (the tokenizer's "
                "vocabulary must fit the model's `vocab_size`)."
            )
        return jnp.asarray(tokens)
    assert isinstance(tokens, jax.Array)
    bad = jnp.any((tokens < 0) | (tokens >= vocab))
    axes = tuple(sorted(varying_axes(bad), key=str))
    if axes:
        bad = jax.lax.psum(bad.astype(jnp.int32), axes) > 0
    # The check is made on a replicated zero added to the tokens.
    zero = eqx.error_if(jnp.zeros((), tokens.dtype), bad, message + ".")
    return tokens + zero

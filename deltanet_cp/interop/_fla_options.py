"""flash-linear-attention's options: those with no counterpart here are refused by name,
those that only steer FLA's kernels are accepted and unused."""

from typing import Any


_GATE = "compute the log decay in JAX and pass it as `g`"
# FLA options with no counterpart here: the value that leaves FLA's result unchanged, and
# what to do instead. Any other value raises a `ValueError` naming the option.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_gate_in_kernel": (False, _GATE),
    "A_log": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "dt_bias": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "lower_bound": (None, f"it is read only with `use_gate_in_kernel=True`: {_GATE}"),
    "safe_gate": (False, _GATE),
    "use_beta_sigmoid_in_kernel": (False, "pass `jax.nn.sigmoid(beta)` as `beta`"),
    "allow_neg_eigval": (False, "pass `2 * jax.nn.sigmoid(beta)` as `beta`"),
    "return_intermediate_states": (False, "intermediate states are not returned"),
    "cp_context": (
        None,
        "for context parallelism pass `cp=deltanet_cp.ContextParallel(axis_name)` to this "
        "function instead (inside `jax.shard_map` on each rank's shard, or with `mesh=` on "
        "global arrays)",
    ),
    "gv": (None, "a decay per value channel is not supported"),
    "reverse": (False, "flip the time axis of the inputs and of the output instead"),
    "head_first": (False, "pass the inputs as `(B, T, H, ...)`"),
}
# FLA options that only steer how its kernels run; accepted and unused.
_HINTS = frozenset({"cu_seqlens_cpu", "chunk_indices", "disable_recompute", "solve_tril_precision"})


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"an array of shape {tuple(shape)}" if shape is not None else repr(value)


def check_options(function: str, options: dict[str, Any], known: tuple[str, ...]) -> None:
    """Refuse FLA's options that `function` does not support.

    **Arguments:**

    - `function`: the adapter's name, for the messages.
    - `options`: the options passed, by name.
    - `known`: the names FLA's `function` takes: any other is a `TypeError`, as Python's
        own for an unexpected keyword.

    **Raises:**

    `TypeError` for an unknown name; `ValueError` for an option with no counterpart here
    that is not at FLA's default, naming it and saying what to do instead.
    """
    for name, value in options.items():
        if name not in known:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        if name in _HINTS:
            continue
        neutral, instead = _UNSUPPORTED[name]
        if value is not neutral:
            raise ValueError(
                f"flash-linear-attention's `{name}` is not supported by "
                f"`deltanet_cp.interop.fla.{function}` (got {_describe(value)}): {instead}."
            )

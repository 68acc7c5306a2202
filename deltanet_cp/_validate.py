"""Checks at the library's boundary: each raises a `TypeError` or a `ValueError` that names
the argument and says what to pass instead, where the computation would otherwise fail deep
inside (an `AttributeError`, a `ZeroDivisionError`) or silently do something else.
"""

import dataclasses
import math
import operator
import typing
from typing import Any, SupportsFloat, SupportsIndex

import jax
import numpy as np


def as_index(value: Any, name: str) -> int:
    """`value` as a Python `int`: an `int`, a NumPy integer, a concrete 0-d integer array.

    **Arguments:**

    - `value`: the value to convert.
    - `name`: the argument's name, for the error message.

    **Returns:**

    `operator.index(value)`.

    **Raises:**

    `TypeError` naming `name` for a bool, a float (even an integral one), a string or a
    traced value.
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be an int; got the bool {value!r}.")
    try:
        return operator.index(value)
    except jax.errors.TracerIntegerConversionError:
        raise TypeError(
            f"`{name}` must be a Python int known when tracing; got a traced value. Pass it as "
            "a static argument (`static_argnums`, or close over it) instead of a jit argument."
        ) from None
    except TypeError:
        raise TypeError(
            f"`{name}` must be an int (or a NumPy integer); got {value!r} of type "
            f"{type(value).__name__}. Pass `{name}=int(...)` if the value is integral."
        ) from None


def as_positive_index(value: Any, name: str) -> int:
    """`value` as a Python `int` of at least 1: the library's one rule for a count or a size.

    Accepts what `as_index` accepts (an `int`, a NumPy integer, a concrete 0-d integer
    array) and refuses the same: `TypeError` naming `name` for a bool, a float (even an
    integral one), a string or a traced value; then `ValueError` naming `name` for a value
    below 1.
    """
    index = as_index(value, name)
    if index < 1:
        raise ValueError(f"`{name}` must be a positive int; got {index}.")
    return index


def as_chunk_size(value: SupportsIndex) -> int:
    """The converter of a recurrence's `chunk_size` field: `as_positive_index` (so
    `np.int64(64)` is accepted and `0` refused)."""
    return as_positive_index(value, "chunk_size")


def as_config_int(name: str, value: Any) -> int:
    """A positive int field of a model config: `as_positive_index`'s rule, each refusal a
    `ValueError` naming the field (the config is a value read from a file)."""
    try:
        return as_positive_index(value, name)
    except (TypeError, ValueError) as error:
        raise ValueError(f"The config's {error}") from None


def as_config_float(name: str, value: Any) -> float:
    """A finite float field of a model config: a float or an int, never a bool or a string;
    a `ValueError` naming the field otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, np.integer, np.floating)
    ):
        raise ValueError(
            f"The config's `{name}` must be a number; got {value!r} of type {type(value).__name__}."
        )
    if not math.isfinite(value):
        raise ValueError(f"The config's `{name}` must be finite; got {value!r}.")
    return float(value)


def as_flag(value: Any, name: str) -> bool:
    """`value` as a Python `bool`: a Python or NumPy bool only (a string such as `"no"`
    would otherwise read as true); a `ValueError` naming `name` otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False; got {value!r}.")


def as_l2norm_flag(value: Any) -> bool:
    """The converter of a recurrence's `use_qk_l2norm` field: `as_flag`."""
    return as_flag(
        value,
        "`use_qk_l2norm` (`use_qk_l2norm_in_kernel` in the flash-linear-attention adapters)",
    )


def as_scale(value: SupportsFloat | None) -> float | None:
    """The converter of a recurrence's `scale` field: a finite Python `float`, or `None`.

    A recurrence is a static configuration (hashed to find its compiled program), so its
    query scale is a Python number: a NumPy scalar or a concrete 0-d array is converted,
    and a traced value is refused with the way round it. The outputs are linear in the
    scale (it multiplies `q`, which enters only the outputs) and the final state does not
    depend on it, so `scale=1.0` followed by `o * scale` is the same computation.
    """
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(f"`scale` must be a float or None; got {value!r}.")
    try:
        scale = float(value)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            "`scale` must be a Python float known when tracing (it is part of the static "
            "configuration); got a traced value. The outputs are linear in the scale and the "
            "final state does not depend on it: pass `scale=1.0` and multiply the outputs by "
            "your traced scale."
        ) from None
    except (TypeError, ValueError):
        raise TypeError(
            f"`scale` must be a float or None (a number or a 0-d array); got {value!r} of "
            f"type {type(value).__name__}."
        ) from None
    if not math.isfinite(scale):
        raise ValueError(f"`scale` must be finite; got {scale}.")
    return scale


def inputs_type(recurrence_type: type) -> type | None:
    """The inputs class a recurrence class declares, `None` if it leaves it generic.

    A recurrence derives from `AbstractRecurrence[Inputs, Factors, Map]`; this reads
    `Inputs` off that base.
    """
    from ._recurrence import AbstractRecurrence  # the engine imports this module

    for klass in recurrence_type.__mro__:
        for base in klass.__dict__.get("__orig_bases__", ()):
            if typing.get_origin(base) is AbstractRecurrence:
                inputs = typing.get_args(base)[0]
                return inputs if isinstance(inputs, type) else None
    return None


def _allows_none(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return "None" in annotation
    return annotation is None or type(None) in typing.get_args(annotation)


def _field_name(path: tuple[Any, ...]) -> str:
    if path and isinstance(path[0], jax.tree_util.GetAttrKey):
        return path[0].name
    return jax.tree_util.keystr(path) or "inputs"


def check_inputs(recurrence: Any, inputs: Any) -> None:
    """Check that `recurrence` is a recurrence and `inputs` the inputs it takes, then ask
    the recurrence to check the inputs' shapes (`recurrence.check`, which assumes the right
    inputs class with its arrays present). The entry points call it once, first.

    **Arguments:**

    - `recurrence`: should be an [`deltanet_cp.AbstractRecurrence`][].
    - `inputs`: should be an instance of the inputs class the recurrence declares
        ([`deltanet_cp.DeltaInputs`][] for the delta rules, [`deltanet_cp.GLAInputs`][] for
        gated linear attention), with an array in every field that does not allow `None`
        and no empty axis after (batch, seq).

    **Raises:**

    `TypeError` for a wrong type of `recurrence` or `inputs`, `ValueError` naming the field
    for a missing array or an empty head or feature axis.
    """
    from ._recurrence import AbstractRecurrence  # the engine imports this module

    if not isinstance(recurrence, AbstractRecurrence):
        raise TypeError(
            "`recurrence` must be a deltanet_cp.AbstractRecurrence, such as "
            f"`deltanet_cp.GatedDeltaRule(chunk_size=64)`; got {type(recurrence).__name__}."
        )
    name = type(recurrence).__name__
    expected = inputs_type(type(recurrence))
    if expected is not None and not isinstance(inputs, expected):
        fields = (
            ", ".join(f.name for f in dataclasses.fields(expected))
            if dataclasses.is_dataclass(expected)
            else "..."
        )
        raise TypeError(
            f"{name} takes `inputs` of type {expected.__name__}; got {type(inputs).__name__}. "
            f"Build them as `deltanet_cp.{expected.__name__}({fields})`."
        )
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        try:
            hints = typing.get_type_hints(type(inputs))
        except (NameError, TypeError):  # unresolvable annotations: read them as written
            hints = {}
        for field in dataclasses.fields(inputs):
            annotation = hints.get(field.name, field.type)
            if getattr(inputs, field.name) is None and not _allows_none(annotation):
                raise ValueError(f"{name} needs `{field.name}`, an array; got None.")
    for path, leaf in jax.tree_util.tree_leaves_with_path(inputs):
        shape = getattr(leaf, "shape", None)
        if shape is not None and 0 in tuple(shape)[2:]:
            raise ValueError(
                f"`{_field_name(path)}` has shape {tuple(shape)}, with an empty axis: every "
                "axis after (batch, seq) (heads, key or value size, Householder steps) must "
                "have at least one element."
            )
    recurrence.check(inputs)

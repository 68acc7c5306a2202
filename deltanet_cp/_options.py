"""The engine's settings as one static value: what a layer or model hands `run` besides its
inputs (chunk size, block size, memory policy, precision policy)."""

from typing import Any

import equinox as eqx

from ._precision import as_precision, PrecisionName
from ._run import as_memory, Memory
from ._validate import as_positive_index


def _chunk_size(value: Any) -> int:
    return as_positive_index(value, "chunk_size")


def _block_size(value: Any) -> int | None:
    return None if value is None else as_positive_index(value, "block_size")


class EngineOptions(eqx.Module):
    """How a layer's recurrence runs through the engine: one static value for the four
    settings every recurrent layer and model of `deltanet_cp` takes (`options=`), so that
    they travel together and a new setting is added here and read in one place.

    ```python
    options = deltanet_cp.EngineOptions(chunk_size=32, memory="high")
    layer = deltanet_cp.nn.GatedDeltaNet(64, 2, 4, 16, 16, options=options, key=key)
    ```

    Every layer also takes the four as loose keyword arguments, as before; passing both is
    a `ValueError`.

    **Fields:**

    - `chunk_size`: tokens per chunk of the recurrence.
    - `block_size`: the engine's block, tokens whose chunk factors are formed together
        (the `block_size` of [`deltanet_cp.run`][]); `None` takes
        [`deltanet_cp.default_block_size`][] (the backend's default).
    - `memory`: what the engine's backward keeps, `"low"` (`None`, the default) or
        `"high"` (the `memory` of [`deltanet_cp.run`][]).
    - `precision`: how the recurrence's large products multiply: `"highest"`,
        `"bfloat16"`, `"default"`, or `None` (from the inputs' dtype); see
        [`deltanet_cp.nn.GatedDeltaNet`][].

    **Raises:**

    `TypeError` if `chunk_size` or `block_size` is not an int (NumPy integers are
    accepted), `ValueError` if one is not positive, or if `memory` or `precision` is not
    one of its names.
    """

    chunk_size: int = eqx.field(default=64, static=True, converter=_chunk_size)
    block_size: int | None = eqx.field(default=None, static=True, converter=_block_size)
    memory: Memory | None = eqx.field(default=None, static=True, converter=as_memory)
    precision: PrecisionName | None = eqx.field(default=None, static=True, converter=as_precision)

    def run_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of [`deltanet_cp.run`][] these options set, `block_size`
        and `memory`: every layer runs its recurrence (made with these options'
        `chunk_size` and `precision`) as `run(recurrence, inputs, ..., **run_kwargs())`,
        so that a new engine setting is read here only."""
        return dict(block_size=self.block_size, memory=self.memory)


def engine_options(
    options: EngineOptions | None,
    chunk_size: Any = None,
    block_size: Any = None,
    memory: Any = None,
    precision: Any = None,
) -> EngineOptions:
    """`options`, or an [`deltanet_cp.EngineOptions`][] of the loose settings (those not
    `None`; the defaults for the others) when it is `None`.

    **Raises:**

    `TypeError` if `options` is not an `EngineOptions`; `ValueError` if both `options` and
    a loose setting are given, or (from `EngineOptions`) for a bad setting.
    """
    loose = dict(chunk_size=chunk_size, block_size=block_size, memory=memory, precision=precision)
    loose = {name: value for name, value in loose.items() if value is not None}
    if options is None:
        return EngineOptions(**loose)
    if not isinstance(options, EngineOptions):
        raise TypeError(
            f"`options` must be a deltanet_cp.EngineOptions; got {type(options).__name__}."
        )
    if loose:
        names = ", ".join(f"`{name}`" for name in loose)
        raise ValueError(
            f"Pass the engine settings either as `options=` or as loose arguments, not both; "
            f"got `options` and {names}: put them in the options, "
            f"`EngineOptions({', '.join(f'{n}=...' for n in loose)}, ...)`."
        )
    return options

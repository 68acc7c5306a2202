"""The interface a recurrence implements for the engine: `AbstractRecurrence`."""

import abc
import dataclasses
import typing
from typing import Any, Generic, TypeVar

import equinox as eqx
import jax
from jaxtyping import Array, PyTree

from ._affine import AbstractAffineMap
from ._validate import as_positive_index, check_log_decay


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

    **Non-finite inputs.** A NaN or infinite input must not reach earlier tokens through a
    chunk's products (zero times NaN is NaN), so the engine forms a chunk from zeros where
    a token's input is not finite and adds NaN back to the outputs from that token on and
    to the state after it. Two declarations on a field of the inputs module (an
    `eqx.Module` whose fields are arrays) refine this; the engine reads them from the
    field's metadata:

    - `eqx.field(metadata={"log_decay": True})`: a log decay. `-inf` there is a legal
        value, a decay of zero (the state forgotten), and reaches the recurrence as it is;
        `prepare` and `step` must take it (finite outputs), and a value above zero is
        refused where the values are concrete. Without the declaration `-inf` is a
        non-finite input: NaN from that token on.
    - `eqx.field(metadata={"output_only": True})`: a value that reaches only its own
        token's outputs, not the state or other tokens (a query): a non-finite value there
        makes only that token's outputs NaN.

    [`deltanet_cp.testing.check_recurrence`][] checks both declarations against `step`
    (its check `"declarations"`), and tells a field whose `step` takes `-inf` but which
    is not declared a log decay.

    The state is `(B, ..., K, V)`, and its row axis `K` may be any size the recurrence
    needs, not only the key size: two `K x V` matrices stacked as rows, a momentum and a
    state $[M; S]$, are one `(B, H, 2K, V)` state whose chunk maps are `(2K, 2K)`.

    [`deltanet_cp.testing.check_recurrence`][] checks a recurrence against all of this.
    """

    chunk_size: eqx.AbstractVar[int]

    def __check_init__(self):
        as_positive_index(self.chunk_size, "chunk_size")

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


class ContractError(ValueError):
    """A `ValueError` from `check_shapes`; `method` names the method that broke the contract."""

    def __init__(self, method: str, message: str):
        super().__init__(message)
        self.method = method


def _shapes(tree: PyTree) -> str:
    return str(jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree))


def check_shapes(
    recurrence: AbstractRecurrence, inputs: PyTree, chunk_size: int
) -> jax.ShapeDtypeStruct:
    """Check `state`, `prepare`, `chunk_map` and `step` against each other on one chunk.

    Abstract evaluation only (`jax.eval_shape`, at trace time: nothing runs), so that a
    contract broken by a user's recurrence is a `ValueError` that names the method instead
    of a reshape or einsum error deep inside the engine.

    **Arguments:**

    - `recurrence`: the recurrence.
    - `inputs`: its inputs, array leaves `(B, T, *rest)`.
    - `chunk_size`: the chunk size the engine runs at.

    **Returns:**

    `recurrence.state(inputs)`.

    **Raises:**

    `ValueError` naming the method: `state` not a batch-leading `jax.ShapeDtypeStruct`
    with `(K, V)` last, or of another shape than `chunk_map`'s maps act on; `prepare`
    leaves without the chunk axis first; `step`'s next state not of `state`'s shape and
    dtype, or outputs without the batch on axis 0 and the chunk's positions on axis 1.
    """
    name = type(recurrence).__name__
    state = recurrence.state(inputs)
    batch = jax.tree.leaves(inputs)[0].shape[0]
    shape = getattr(state, "shape", None)
    if (
        not isinstance(state, jax.ShapeDtypeStruct)
        or shape is None
        or len(shape) < 3
        or shape[0] != batch
    ):
        raise ContractError(
            "state",
            f"{name}.state(inputs) must return a jax.ShapeDtypeStruct of shape (B, ..., K, V) "
            f"with the batch B = {batch} first, e.g. jax.ShapeDtypeStruct((B, H, K, V), "
            f"jnp.float32); got {state!r}.",
        )
    chunk = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((x.shape[0], 1, chunk_size, *x.shape[2:]), x.dtype),
        inputs,
    )
    h = jax.ShapeDtypeStruct(state.shape, state.dtype)
    factors = eqx.filter_eval_shape(recurrence.prepare, chunk)
    wrong = [x.shape for x in jax.tree.leaves(factors) if not x.shape or x.shape[0] != 1]
    if wrong:
        raise ContractError(
            "prepare",
            f"{name}.prepare(chunks) must return factors with the chunk index on the leading "
            f"axis of every leaf; on one chunk (chunks of shape (B, 1, C, ...)) it returned "
            f"leaves of shapes {wrong}, whose leading axis is not 1.",
        )
    one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), factors)
    affine = eqx.filter_eval_shape(recurrence.chunk_map, one)
    if not isinstance(affine, AbstractAffineMap):
        raise ContractError(
            "chunk_map",
            f"{name}.chunk_map(factors) must return a deltanet_cp.AbstractAffineMap (an "
            f"AffineMap or a DiagonalAffineMap); got {type(affine).__name__}.",
        )
    if tuple(affine.U.shape) != tuple(state.shape):
        raise ContractError(
            "state",
            f"{name}.state(inputs) says the state has shape {tuple(state.shape)}, but "
            f"{name}.chunk_map(factors) returns a map of states of shape "
            f"{tuple(affine.U.shape)} (its `U`): one of them has the wrong sizes (the last "
            "two axes are the state's (K, V)).",
        )
    try:
        h_next, outputs = eqx.filter_eval_shape(recurrence.step, one, h)
    except Exception as error:
        raise ContractError(
            "step",
            f"{name}.step(factors, h) failed on a state of the shape {name}.state(inputs) "
            f"gives, {tuple(state.shape)} {state.dtype}: {type(error).__name__}: {error}",
        ) from error
    if (h_next.shape, h_next.dtype) != (h.shape, h.dtype):
        raise ContractError(
            "step",
            f"{name}.step(factors, h) must return the next state with the shape and dtype of "
            f"{name}.state(inputs), {tuple(state.shape)} {state.dtype}; got "
            f"{tuple(h_next.shape)} {h_next.dtype}.",
        )
    bad = [
        x.shape
        for x in jax.tree.leaves(outputs)
        if len(x.shape) < 2 or tuple(x.shape[:2]) != (batch, chunk_size)
    ]
    if bad:
        raise ContractError(
            "step",
            f"{name}.step(factors, h) must return outputs with the batch on axis 0 and the "
            f"chunk's positions on axis 1, (B, C, ...) = ({batch}, {chunk_size}, ...); got "
            f"outputs of shapes {_shapes(outputs)}. Move the chunk's axis to position 1 "
            "(for example (B, H, C, V) -> (B, C, H, V) with jnp.swapaxes).",
        )
    return state


def inputs_type(recurrence_type: type) -> type | None:
    """The inputs class a recurrence class declares, `None` if it leaves it generic.

    A recurrence derives from `AbstractRecurrence[Inputs, Factors, Map]`; this reads
    `Inputs` off that base.
    """
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
    for a missing array or an empty head or feature axis, and, where the values are
    concrete (not traced under `jax.jit`, `grad`, `vmap` or `shard_map`), for a positive
    finite log decay (a field declared with `eqx.field(metadata={"log_decay": True})`).
    """
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
    if dataclasses.is_dataclass(inputs) and not isinstance(inputs, type):
        for field in dataclasses.fields(inputs):
            if field.metadata.get("log_decay", False):
                for leaf in jax.tree.leaves(getattr(inputs, field.name)):
                    check_log_decay(leaf, field.name, name)

"""Check your own recurrence against the contract the engine relies on: `check_recurrence`.

```python
from deltanet_cp.testing import check_recurrence

check_recurrence(MyRecurrence(chunk_size=8), my_inputs)  # raises on the first broken law
```

The laws are those of [`deltanet_cp.AbstractRecurrence`][], checked on small inputs: each is
one the engine assumes without being able to see it (a `step` that is not affine in `h`
runs, and is silently wrong under differentiation and context parallelism).
"""

import dataclasses
import functools as ft
import math
import warnings
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, PyTree

from ._exchange import AbstractExchange, as_exchange, ExchangeName
from ._parallel import AbstractLayout, ContextParallel, Contiguous, Zigzag
from ._recurrence import AbstractRecurrence, check_inputs, check_shapes, ContractError
from ._run import run


__all__ = ["check_recurrence", "RecurrenceCheckError"]


class RecurrenceCheckError(AssertionError):
    """A law of [`deltanet_cp.AbstractRecurrence`][] that a recurrence breaks.

    An `AssertionError`, so that pytest reports it as a failed check. `check` is the
    check's name (one of the keys [`deltanet_cp.testing.check_recurrence`][] returns);
    the message names the method and says what it returned and what was expected.
    """

    check: str

    def __init__(self, check: str, message: str):
        super().__init__(f"[{check}] {message}")
        self.check = check


def check_recurrence(
    recurrence: AbstractRecurrence,
    inputs: PyTree,
    *,
    initial_state: Array | None = None,
    cp: Sequence[int] = (2, 4),
    layouts: Sequence[AbstractLayout] = (Contiguous(), Zigzag()),
    exchange: AbstractExchange | ExchangeName = "allgather",
    gradients: bool = True,
    unchunked: AbstractRecurrence | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> dict[str, float]:
    r"""Check that a recurrence keeps the contract of [`deltanet_cp.AbstractRecurrence`][].

    In this order, each check raising a [`deltanet_cp.testing.RecurrenceCheckError`][]
    that names the method at fault:

    1. `"shapes"`: `state` returns a batch-leading `jax.ShapeDtypeStruct` of the shape
        `chunk_map`'s maps act on; `prepare` puts the chunk index first; `step` returns a
        next state of `state`'s shape and dtype and outputs `(B, C, ...)` (the checks
        [`deltanet_cp.run`][] makes when it traces).
    2. `"zero token"`: a chunk whose inputs are all zero (the engine's padding) leaves a
        random state unchanged.
    3. `"affine step"`: `step` is affine in `h`: with random states $h_1, h_2$ and
        $a = 0.3$, `step(f, a h1 + (1 - a) h2)` is `a step(f, h1) + (1 - a) step(f, h2)`,
        outputs and next state (the engine's hand-written backward and context
        parallelism both rely on it).
    4. `"chunk_map"`: `chunk_map(f)(h) == step(f, h)[0]` for every chunk of `inputs`.
    5. `"compose"`: `compose(f, running)` returns a map of `running`'s type and shapes
        equal to `running.then(chunk_map(f))`, and composing every chunk takes the initial
        state to the final one.
    6. `"chunked"`: [`deltanet_cp.run`][] equals a plain `lax.scan` of `step`, and the same
        run at `chunk_size=1` (`unchunked`), also with one chunk per block (`prepare` must
        treat chunks independently).
    7. `"gradients"` (if `gradients`): `jax.grad` of a random weighted sum of the outputs
        and final state through [`deltanet_cp.run`][] (whose backward the engine writes by
        hand) equals `jax.grad` through a plain `lax.scan` of `unchunked`'s `step`, token by
        token, for every floating input and the initial state.
    8. `"declarations"`: the inputs' field declarations (see
        [`deltanet_cp.AbstractRecurrence`][], *Non-finite inputs*) agree with `step`: a
        field declared a log decay with `-inf` at one token gives finite outputs equal to a
        plain `lax.scan` of `step`; a floating field not declared one, whose `step` takes
        `-inf` at that token to finite outputs, is reported (the engine would turn that
        token's `-inf` into NaN outputs); a field declared `output_only` changed at one
        token changes no other token's outputs and not the state.
    9. `"cp=N, layout"`: for each `N` in `cp` and each layout, [`deltanet_cp.run`][] with
        a [`deltanet_cp.ContextParallel`][] over a mesh of `N` devices equals one device,
        outputs, final state and (if `gradients`) gradients. The inputs are zero-padded to
        a multiple of the layout's pieces. Skipped, with a warning that says how to get the
        devices, when `jax.devices()` has fewer than `N`.

    Every comparison passes when $\max |a - e| \le \text{atol} + \text{rtol} \max |e|$.
    Use small inputs (a few chunks; a length that is not a multiple of the chunk size
    exercises the padding), with values of order one: the checks compile a handful of
    programs and unroll Python loops over the chunks.

    **Arguments:**

    - `recurrence`: the recurrence to check.
    - `inputs`: its inputs, array leaves `(B, T, ...)`, with `T` more than
        `recurrence.chunk_size` (at least two chunks).
    - `initial_state`: the state before the first token; a random one if `None` (a zero
        state would hide a wrong read of it).
    - `cp`: the numbers of devices to check context parallelism on; `()` for none.
    - `layouts`: the layouts to check it with.
    - `exchange`: the exchange, as in [`deltanet_cp.ContextParallel`][].
    - `gradients`: also check gradients (on one device and under context parallelism).
    - `unchunked`: the recurrence at `chunk_size=1`; `None` takes
        `dataclasses.replace(recurrence, chunk_size=1)`, which suits a recurrence whose
        fields are its constructor's arguments (pass it yourself otherwise).
    - `rtol`, `atol`: the tolerances of every comparison; if `None`, from the precision the
        recurrence computes at: `1e-4` and `1e-5` in float32 or float64, `1e-2` and `1e-3`
        when its products run in bfloat16 (a `precision="bfloat16"` field, or bfloat16
        inputs under the default policy), whose 8-bit significand rounds each product by up
        to `4e-3`.
    - `seed`: seeds the random states and loss weights.

    **Returns:**

    A dict from each check that ran to the largest relative error it saw,
    $\max |a - e| / \max |e|$.

    **Raises:**

    [`deltanet_cp.testing.RecurrenceCheckError`][] (an `AssertionError`) at the first
    broken law; `ValueError` for inputs of less than two chunks or an empty batch, and for
    options that would fail inside or check nothing: `cp` not a sequence of ints >= 1,
    `layouts` empty while `cp` is not (or not layouts), `gradients` not a bool, `unchunked`
    not at `chunk_size=1`, `rtol` or `atol` not finite and >= 0, `seed` not an int >= 0.
    """
    low = _bfloat16_products(recurrence, inputs)
    rtol = (1e-2 if low else 1e-4) if rtol is None else rtol
    atol = (1e-3 if low else 1e-5) if atol is None else atol
    cp, layouts, exchange, gradients, rtol, atol, seed = _arguments(
        cp, layouts, exchange, gradients, unchunked, rtol, atol, seed
    )
    errors: dict[str, float] = {}
    compare = ft.partial(_compare, errors=errors, rtol=rtol, atol=atol)
    check_inputs(recurrence, inputs)  # what `run` checks first (types, `recurrence.check`)
    name = type(recurrence).__name__
    batch, length = _batch_and_length(inputs)
    if batch == 0:
        raise ValueError(
            "check_recurrence needs inputs with at least one batch row: with B = 0 every "
            "comparison is of empty arrays and passes whatever the recurrence does."
        )
    c = recurrence.chunk_size
    if length <= c:
        raise ValueError(
            f"check_recurrence needs inputs of at least two chunks: T = {length} tokens with "
            f"chunk_size={c}. Pass longer inputs or a recurrence with a smaller chunk_size."
        )
    if unchunked is None:
        try:
            unchunked = dataclasses.replace(recurrence, chunk_size=1)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"dataclasses.replace({name}(...), chunk_size=1) failed ({error}): pass the "
                "recurrence at chunk_size=1 as `unchunked=`."
            ) from error

    # 1. Shapes, abstractly (the engine's own check at trace time).
    try:
        state = check_shapes(recurrence, inputs, c)
    except ContractError as error:
        raise RecurrenceCheckError("shapes", str(error)) from error
    errors["shapes"] = 0.0
    rng = np.random.default_rng(seed)

    def random_state():
        return jnp.asarray(rng.normal(size=state.shape), state.dtype)

    h0 = random_state() if initial_state is None else jnp.asarray(initial_state, state.dtype)
    if h0.shape != state.shape:
        raise ValueError(
            f"`initial_state` has shape {h0.shape}; {name}.state(inputs) says {state.shape}."
        )
    n = -(-length // c)
    chunks = jax.tree.map(lambda x: _pad(x, n * c).reshape(batch, n, c, *x.shape[2:]), inputs)
    zero = jax.tree.map(lambda x: jnp.zeros_like(x[:, :1]), chunks)
    h1, h2 = random_state(), random_state()
    laws = _laws(recurrence, chunks, zero, h0, h1, h2)

    # 2. A chunk of zero tokens is the identity.
    compare(
        "zero token",
        f"{name}.step(prepare(zeros), h)[0] on a chunk whose inputs are all zero (the "
        "engine's padding) must return h unchanged",
        laws["zero"],
        h1,
    )
    # 3. `step` is affine in `h`.
    for i, (stepped, mixed) in enumerate(laws["affine"]):
        what = (
            f"{name}.step(factors, h) must be affine in h: at chunk {i}, "
            "step(f, a h1 + (1 - a) h2) != a step(f, h1) + (1 - a) step(f, h2), a = 0.3, "
        )
        compare("affine step", what + "in the next state", stepped[0], mixed[0])
        compare("affine step", what + "in the outputs", stepped[1], mixed[1])
    # 4. `chunk_map` agrees with `step`.
    for i, (mapped, stepped) in enumerate(laws["chunk_map"]):
        compare(
            "chunk_map",
            f"{name}.chunk_map(factors)(h) must equal step(factors, h)[0]: at chunk {i}",
            mapped,
            stepped,
        )
    # 5. `compose` agrees with `then`.
    for i, (composed, then) in enumerate(laws["compose"], start=1):
        if type(composed) is not type(then) or _struct(composed) != _struct(then):
            raise RecurrenceCheckError(
                "compose",
                f"{name}.compose(factors, running) must return a map of the type and shapes of "
                f"running.then(chunk_map(factors)): at chunk {i} it returned "
                f"{type(composed).__name__} {_struct(composed)}, expected "
                f"{type(then).__name__} {_struct(then)}.",
            )
        what = (
            f"{name}.compose(factors, running) must equal running.then(chunk_map(factors)): at "
            f"chunk {i}, applied to "
        )
        compare("compose", what + "a random state", composed(h1), then(h1))
        compare("compose", what + "zero", composed.U, then.U)
    compare(
        "compose",
        f"composing every chunk with {name}.compose must take the initial state to the final "
        "state of stepping through them",
        laws["folded"],
        laws["final"],
    )

    # 6. The engine against a plain scan of `step`, chunked and unchunked, and per block.
    diff, static = eqx.partition(inputs, eqx.is_inexact_array)
    shapes = eqx.filter_eval_shape(_run, recurrence, diff, static, h0, None)
    weights = jax.tree.map(lambda y: jnp.asarray(rng.normal(size=y.shape), y.dtype), shapes)
    (o, final), grads = _engine(recurrence, diff, static, h0, weights, gradients)
    scanned = _scan(recurrence, diff, static, h0)
    what = f"deltanet_cp.run({name}(chunk_size={c}), ...) must equal "
    compare("chunked", what + "a plain lax.scan of its step: outputs", o, scanned[0])
    compare("chunked", what + "a plain lax.scan of its step: final state", final, scanned[1])
    o1, final1 = _engine(unchunked, diff, static, h0, weights, False)[0]
    what = f"{what}the same run at chunk_size=1"
    compare("chunked", what + ": outputs", o, o1)
    compare("chunked", what + ": final state", final, final1)
    ob, finalb = _engine(recurrence, diff, static, h0, weights, False, block_size=c)[0]
    what = (
        f"deltanet_cp.run({name}(...), block_size=chunk_size) (one chunk per call of prepare) "
        "must equal one block: prepare must treat the chunks of a block independently"
    )
    compare("chunked", what + ": outputs", ob, o)
    compare("chunked", what + ": final state", finalb, final)

    # 7. Gradients: the engine's hand-written backward against autodiff, token by token.
    if gradients:
        compare(
            "gradients",
            f"jax.grad through deltanet_cp.run({name}(...)) must equal jax.grad through a "
            "token-by-token lax.scan of its step (chunk_size=1): (inputs, initial state)",
            grads,
            _scan_grads(unchunked, diff, static, h0, weights),
        )

    # 8. The inputs' declarations (log decays, output-only fields) against `step`.
    _check_declarations(recurrence, inputs, h0, weights, compare, name)

    # 9. Context parallelism against one device.
    for devices in cp:
        available = len(jax.devices())
        if available < devices:
            warnings.warn(
                f"check_recurrence: context parallelism on {devices} devices skipped, jax "
                f"sees {available}. On a CPU, simulate devices by setting XLA_FLAGS="
                f"--xla_force_host_platform_device_count={devices} before importing jax.",
                stacklevel=2,
            )
            continue
        mesh = jax.make_mesh((devices,), ("cp",), devices=jax.devices()[:devices])
        for layout in layouts:
            parallel = ContextParallel("cp", layout=layout, exchange=exchange, mesh=mesh)
            check = f"cp={devices}, {type(layout).__name__}"
            what = (
                f"deltanet_cp.run({name}(...), cp=ContextParallel(mesh of {devices} devices, "
                f"layout={layout!r})) must equal one device: "
            )
            pieces = layout.pieces(devices)
            padded = -(-length // pieces) * pieces
            (o_cp, final_cp), grads_cp = _engine(
                recurrence, diff, static, h0, weights, gradients, cp=parallel, padded=padded
            )
            compare(check, what + "outputs", o_cp, o)
            compare(check, what + "final state", final_cp, final)
            if gradients:
                compare(check, what + "gradients (inputs, initial state)", grads_cp, grads)
    return errors


def _check_declarations(recurrence, inputs, h0, weights, compare, name: str) -> None:
    """Check 8 of `check_recurrence`: each floating field of `inputs` changed at one token
    (batch row 0, the first token of the second chunk), against a plain scan of `step`."""
    if not dataclasses.is_dataclass(inputs):
        return
    token = recurrence.chunk_size
    for field in dataclasses.fields(inputs):
        x = getattr(inputs, field.name)
        if not eqx.is_inexact_array(x):
            continue
        decay = bool(field.metadata.get("log_decay", False))
        changed = _with(inputs, field.name, x.at[0, token].set(-jnp.inf))
        diff, static = eqx.partition(changed, eqx.is_inexact_array)
        stepped = _scan(recurrence, diff, static, h0)
        finite = all(bool(jnp.all(jnp.isfinite(y))) for y in jax.tree.leaves(stepped))
        if decay:
            what = (
                f"`{field.name}` is declared a log decay, so -inf (a decay of zero) at token "
                f"{token} must run: deltanet_cp.run({name}(...)) must equal a plain lax.scan "
                "of its step"
            )
            if not finite:
                raise RecurrenceCheckError(
                    "declarations",
                    f"{what}, and the scan's outputs or final state are not finite. Make "
                    f"step take -inf in `{field.name}` as a decay of zero, or drop the "
                    "declaration.",
                )
            (o, final), _ = _engine(recurrence, diff, static, h0, weights, False)
            compare("declarations", what + ": outputs", o, stepped[0])
            compare("declarations", what + ": final state", final, stepped[1])
        elif finite:
            raise RecurrenceCheckError(
                "declarations",
                f"{name}.step takes -inf in `{field.name}` (at token {token}) to finite outputs, "
                f"as a log decay, but `{field.name}` is not declared one: the engine treats "
                "-inf there as a non-finite input and returns NaN from that token on. Declare "
                f'it with `{field.name}: ... = eqx.field(metadata={{"log_decay": True}})`.',
            )
        if field.metadata.get("output_only", False):
            moved = _with(inputs, field.name, x.at[0, token].add(1.0))
            before = _scan(recurrence, *eqx.partition(inputs, eqx.is_inexact_array), h0)
            after = _scan(recurrence, *eqx.partition(moved, eqx.is_inexact_array), h0)
            what = (
                f"`{field.name}` is declared output_only, so changing it at token {token} must "
                "change only that token's outputs: "
            )
            others = jnp.arange(_batch_and_length(inputs)[1]) != token
            for y0, y1 in zip(jax.tree.leaves(before[0]), jax.tree.leaves(after[0])):
                compare(
                    "declarations", what + "other tokens' outputs", y1[:, others], y0[:, others]
                )
            compare("declarations", what + "the final state", after[1], before[1])


def _bfloat16_products(recurrence: AbstractRecurrence, inputs: PyTree) -> bool:
    """Whether `recurrence` multiplies in bfloat16: its `precision` field says so, or it
    follows the inputs (`None`) and one of them is bfloat16."""
    precision = getattr(recurrence, "precision", None)
    if precision == "bfloat16":
        return True
    leaves = [x for x in jax.tree.leaves(inputs) if eqx.is_inexact_array(x)]
    return precision is None and any(x.dtype == jnp.bfloat16 for x in leaves)


def _with(inputs: Any, name: str, value: Array) -> Any:
    return eqx.tree_at(lambda i: getattr(i, name), inputs, value)


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _arguments(
    cp: Any,
    layouts: Any,
    exchange: Any,
    gradients: Any,
    unchunked: Any,
    rtol: Any,
    atol: Any,
    seed: Any,
) -> tuple[tuple[int, ...], tuple[AbstractLayout, ...], AbstractExchange, bool, float, float, int]:
    """`check_recurrence`'s options, checked: a `ValueError` that names the one to change
    (each of them would otherwise fail deep inside, or make a check pass vacuously)."""
    if isinstance(cp, (str, bytes)) or not isinstance(cp, Sequence):
        raise ValueError(
            f"`cp` must be a sequence of device counts, such as (2, 4) or (2,), or () for no "
            f"context parallelism; got {cp!r}."
        )
    if not all(_is_int(n) and n >= 1 for n in cp):
        raise ValueError(f"`cp` must hold device counts, ints >= 1; got {tuple(cp)!r}.")
    if isinstance(layouts, (str, bytes)) or not isinstance(layouts, Sequence):
        raise ValueError(
            "`layouts` must be a sequence of deltanet_cp.AbstractLayout instances, such as "
            f"(Contiguous(), Zigzag()); got {layouts!r}."
        )
    if not all(isinstance(layout, AbstractLayout) for layout in layouts):
        raise ValueError(
            "`layouts` must hold deltanet_cp.AbstractLayout instances, such as Contiguous() "
            f"or Zigzag(); got {tuple(layouts)!r}."
        )
    if cp and not layouts:
        raise ValueError(
            f"layouts=() with cp={tuple(cp)!r} would check no context parallelism at all: pass "
            "the layouts to check (such as (Contiguous(),)), or cp=() to skip context "
            "parallelism."
        )
    if not isinstance(gradients, (bool, np.bool_)):
        raise ValueError(f"`gradients` must be True or False; got {gradients!r}.")
    if unchunked is not None:
        if not isinstance(unchunked, AbstractRecurrence):
            raise ValueError(
                "`unchunked` must be the recurrence at chunk_size=1 (a "
                f"deltanet_cp.AbstractRecurrence) or None; got {type(unchunked).__name__}."
            )
        if unchunked.chunk_size != 1:
            raise ValueError(
                "`unchunked` must be the recurrence at chunk_size=1; got chunk_size="
                f"{unchunked.chunk_size}."
            )
    for name, tolerance in (("rtol", rtol), ("atol", atol)):
        if not (_is_real(tolerance) and math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(
                f"`{name}` must be a finite number >= 0 (a NaN bound fails every comparison, "
                f"an infinite one passes them all); got {tolerance!r}."
            )
    if not (_is_int(seed) and seed >= 0):
        raise ValueError(f"`seed` must be an int >= 0; got {seed!r}.")
    return (
        tuple(int(n) for n in cp),
        tuple(layouts),
        as_exchange(exchange),
        bool(gradients),
        float(rtol),
        float(atol),
        int(seed),
    )


def _batch_and_length(inputs: PyTree) -> tuple[int, int]:
    leaves = jax.tree.leaves(inputs)
    if not leaves or any(getattr(x, "ndim", 0) < 2 for x in leaves):
        raise ValueError("The inputs must be arrays with the batch on axis 0 and time on axis 1.")
    return leaves[0].shape[0], leaves[0].shape[1]


def _pad(x: Array, length: int) -> Array:
    """`x` zero-padded (`False` for booleans) along time, axis 1, to `length`."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, length - x.shape[1])
    return jnp.pad(x, pad)


def _struct(tree: PyTree) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, [(tuple(x.shape), str(x.dtype)) for x in leaves]


def _compare(
    check: str,
    what: str,
    actual: PyTree,
    expected: PyTree,
    *,
    errors: dict[str, float],
    rtol: float,
    atol: float,
) -> None:
    """Leaf by leaf, `max |a - e| <= atol + rtol max |e|`, else a `RecurrenceCheckError`."""
    a_leaves, a_def = jax.tree.flatten(actual)
    e_leaves, e_def = jax.tree.flatten(expected)
    if a_def != e_def:
        raise RecurrenceCheckError(check, f"{what}; got a PyTree {a_def}, expected {e_def}.")
    worst = 0.0
    for a, e in zip(a_leaves, e_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        if a.shape != e.shape:
            raise RecurrenceCheckError(
                check, f"{what}; got an array of shape {a.shape}, expected {e.shape}."
            )
        if not a.size:
            continue
        scale, diff = float(np.max(np.abs(e))), float(np.max(np.abs(a - e)))
        bound = atol + rtol * scale
        if not diff <= bound:  # NaN fails too
            raise RecurrenceCheckError(
                check,
                f"{what}; max |difference| {diff:.3g} > atol + rtol * max |expected| = "
                f"{bound:.3g} (max |expected| {scale:.3g}).",
            )
        worst = max(worst, diff / max(scale, np.finfo(np.float64).tiny))
    errors[check] = max(errors.get(check, 0.0), worst)


@eqx.filter_jit
def _laws(recurrence, chunks, zero, h0, h1, h2) -> dict[str, Any]:
    """The per-chunk laws' two sides, on the chunks `(B, N, C, ...)` of the inputs."""
    factors = recurrence.prepare(chunks)
    n = jax.tree.leaves(chunks)[0].shape[1]
    f = [jax.tree.map(lambda x: x[i], factors) for i in range(n)]
    zero_f = jax.tree.map(lambda x: x[0], recurrence.prepare(zero))
    a = 0.3
    affine, mapped, h = [], [], h0
    for f_i in f:
        s1, s2 = recurrence.step(f_i, h1), recurrence.step(f_i, h2)
        mixed = jax.tree.map(lambda x, y: a * x + (1 - a) * y, s1, s2)
        affine.append((recurrence.step(f_i, a * h1 + (1 - a) * h2), mixed))
        h_next = recurrence.step(f_i, h)[0]
        mapped.append((recurrence.chunk_map(f_i)(h), h_next))
        h = h_next
    compose, running = [], recurrence.chunk_map(f[0])
    for f_i in f[1:]:
        then = running.then(recurrence.chunk_map(f_i))
        running = recurrence.compose(f_i, running)
        compose.append((running, then))
    return dict(
        zero=recurrence.step(zero_f, h1)[0],
        affine=affine,
        chunk_map=mapped,
        compose=compose,
        folded=running(h0),
        final=h,
    )


def _scan(recurrence, diff, static, h0):
    """`(outputs, final state)` of a plain `lax.scan` of `step` over the chunks."""
    inputs = eqx.combine(diff, static)
    batch, length = _batch_and_length(inputs)
    c = recurrence.chunk_size
    n = -(-length // c)
    chunks = jax.tree.map(lambda x: _pad(x, n * c).reshape(batch, n, c, *x.shape[2:]), inputs)
    final, outputs = jax.lax.scan(
        lambda h, f: recurrence.step(f, h), h0, recurrence.prepare(chunks)
    )
    outputs = jax.tree.map(
        lambda y: jnp.moveaxis(y, 0, 1).reshape(batch, n * c, *y.shape[3:])[:, :length], outputs
    )
    return recurrence.finalize(outputs, inputs), final


_scan = eqx.filter_jit(_scan)


def _loss(outputs, final, weights):
    w_o, w_h = weights
    terms = jax.tree.map(lambda y, w: jnp.sum(y * w), outputs, w_o)
    return sum(jax.tree.leaves(terms)) + jnp.sum(final * w_h)


def _run(recurrence, diff, static, h0, block_size=None, cp=None, padded=None):
    inputs = eqx.combine(diff, static)
    length = _batch_and_length(inputs)[1]
    if padded is not None:
        inputs = jax.tree.map(lambda x: _pad(x, padded), inputs)
    outputs, final = run(recurrence, inputs, initial_state=h0, cp=cp, block_size=block_size)
    return jax.tree.map(lambda y: y[:, :length], outputs), final


@eqx.filter_jit
def _engine(
    recurrence, diff, static, h0, weights, gradients, *, block_size=None, cp=None, padded=None
):
    """`((outputs, final state), gradients or None)` of `run`, in one program."""

    def loss(diff, h0):
        result = _run(recurrence, diff, static, h0, block_size, cp, padded)
        return _loss(*result, weights), result

    if not gradients:
        return _run(recurrence, diff, static, h0, block_size, cp, padded), None
    grads, result = jax.grad(loss, argnums=(0, 1), has_aux=True)(diff, h0)
    return result, grads


@eqx.filter_jit
def _scan_grads(recurrence, diff, static, h0, weights):
    def loss(diff, h0):
        return _loss(*_scan(recurrence, diff, static, h0), weights)

    return jax.grad(loss, argnums=(0, 1))(diff, h0)

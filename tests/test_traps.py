"""Smaller traps: arguments that used to give an internal error, or a silently wrong answer.

Most of these are eager checks that compile nothing.
"""

import functools as ft
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

import deltanet_cp as dcp
from deltanet_cp.nn import CausalConv1d
from tests import _stall


ROOT = Path(__file__).resolve().parent.parent


def test_subpackages_are_attributes():
    # In a fresh process: in this one, other tests may have imported the subpackages already.
    code = (
        "import deltanet_cp\n"
        "for name in ('nn', 'models', 'interop', 'chunkops', 'testing'):\n"
        "    getattr(deltanet_cp, name)\n"
        "deltanet_cp.nn.GatedDeltaNet, deltanet_cp.models.Qwen3_5ForCausalLM\n"
        "deltanet_cp.interop.fla.chunk_gated_delta_rule\n"
    )
    result = _stall.run([sys.executable, "-c", code], cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_functions_have_flas_names():
    # One name per function, FLA's: `chunk_X` here for FLA's `chunk_X`, with `recurrent_X`
    # beside it (`help(deltanet_cp.chunk_kda)` finds the function).
    from deltanet_cp.interop import fla

    chunked = [n for n in dir(dcp) if n.startswith("chunk_")]
    assert "chunk_kda" in chunked and "recurrent_kda" in dir(dcp)
    assert not hasattr(dcp, "chunk_kimi_delta_attention")
    for name in chunked:
        assert hasattr(fla, name), name
        assert hasattr(dcp, "recurrent_" + name[len("chunk_") :]), name


def _gdn_inputs(b=1, t=8, h=1, k=4, v=4):
    q = jnp.ones((b, t, h, k)) / 2
    return q, q, jnp.ones((b, t, h, v)), -jnp.ones((b, t, h)), jnp.full((b, t, h), 0.5)


def test_context_parallel_without_mesh_outside_shard_map():
    # JAX alone says `NameError: unbound axis name: cp`.
    cp = dcp.ContextParallel("cp")
    match = r"no `mesh`.*inside `jax.shard_map`.*mesh=mesh"
    with pytest.raises(ValueError, match=match):
        dcp.chunk_gated_delta_rule(*_gdn_inputs(), cp=cp)
    with pytest.raises(ValueError, match=match):
        dcp.recurrent_gated_delta_rule(*_gdn_inputs(), cp=cp)
    recurrence, inputs = dcp.GatedDeltaRule(), dcp.DeltaInputs(*_gdn_inputs())
    with pytest.raises(ValueError, match=match):
        dcp.internal.run_contiguous(recurrence, inputs, cp=cp)
    conv = CausalConv1d(4, 3, key=jr.key(0))
    with pytest.raises(ValueError, match=match):
        conv(jnp.ones((8, 4)), cp=cp)


def test_context_parallel_init_documents_its_arguments():
    doc = dcp.ContextParallel.__init__.__doc__ or ""
    for name in ("axis_name", "layout", "exchange", "mesh", "batch_axis"):
        assert f"- `{name}`:" in doc, name


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(bandwidth=0.0),
        dict(bandwidth=-1e9),
        dict(bandwidth=float("inf")),
        dict(bandwidth=float("nan")),
        dict(bandwidth="50e9"),
        dict(latency=-1e-6),
        dict(latency=float("nan")),
        dict(latency=True),
    ],
)
def test_auto_parameters(kwargs, without_runtime_typecheck):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"`{name}` must be a finite number"):
        dcp.Auto(**kwargs)
    with pytest.raises(ValueError, match=f"`{name}` must be a finite number"):
        dcp.AllGather().estimated_seconds(4, map_elements=16, state_elements=4, **kwargs)


def test_auto_accepts_numbers(without_runtime_typecheck):
    auto = dcp.Auto(latency=0, bandwidth=np.float32(1e9))  # pyright: ignore[reportArgumentType]
    assert auto.choose(4, map_elements=16, state_elements=4)


def _family_args(name):
    # Small valid inputs of each kind, from the library's own input makers.
    from tests import helpers

    return {
        "gated_delta_rule": helpers.make_gated_delta_inputs,
        "kda": helpers.make_kda_inputs,
        "gla": helpers.make_gla_inputs,
        "precond_gated_delta_rule": helpers.make_precond_gdn_inputs,
        "momentum_delta_rule": helpers.make_momentum_inputs,
    }[name](0, t=8, dk=4, dv=4)[0]


@pytest.mark.parametrize(
    "fn, index, name, value",
    [
        ("gated_delta_rule", 3, "g", 0.5),  # a positive log decay: the state grows
        ("gated_delta_rule", 4, "beta", 3.0),  # |o| up to 4e34
        ("gated_delta_rule", 4, "beta", -0.5),
        ("kda", 3, "g", 0.5),
        ("kda", 4, "beta", 3.0),  # NaN
        ("gla", 3, "g", 0.5),
        ("precond_gated_delta_rule", 3, "g_atk", 0.5),
        ("precond_gated_delta_rule", 4, "g", 0.5),
        ("precond_gated_delta_rule", 5, "beta_atk", -1.0),
        ("precond_gated_delta_rule", 6, "beta", 3.0),
        ("momentum_delta_rule", 3, "log_alpha", 0.5),
    ],
)
@pytest.mark.parametrize("entry", ["chunk", "recurrent"])
def test_gate_ranges_of_concrete_values(fn, index, name, value, entry):
    args = list(_family_args(fn))
    args[index] = args[index].at[0, 5].set(value)
    with pytest.raises(ValueError, match=f"`{name}` must be"):
        getattr(dcp, f"{entry}_{fn}")(*args)


def test_gate_ranges_accept_the_edges_and_leave_traced_values():
    q, k, v, g, beta = _family_args("gated_delta_rule")
    edges = dict(g=g.at[0, 1].set(0.0).at[0, 2].set(-jnp.inf), beta=beta.at[0, 1].set(2.0))
    dcp.chunk_gated_delta_rule(q, k, v, edges["g"], edges["beta"].at[0, 2].set(0.0))
    # Traced: not checked (documented), no callback in the program.
    o, _ = jax.jit(dcp.chunk_gated_delta_rule)(q, k, v, g.at[0, 5].set(0.5), beta)
    assert o.shape == v.shape


def _fla_gdn_args():
    return _family_args("gated_delta_rule")  # K == V: a transposed state has the same shape


@pytest.mark.parametrize("flag", ["state_v_first", "output_final_state"])
@pytest.mark.parametrize("fn", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"])
def test_fla_adapters_refuse_non_bool_flags(fn, flag, without_runtime_typecheck):
    from deltanet_cp.interop import fla

    q, k, v, g, beta = _fla_gdn_args()
    h0 = jnp.zeros((1, 2, 4, 4))
    with pytest.raises(ValueError, match=f"`{flag}` must be True or False; got 'no'"):
        getattr(fla, fn)(q, k, v, g=g, beta=beta, initial_state=h0, **{flag: "no"})


@pytest.mark.parametrize("flag", ["transpose_state_layout", "output_final_state"])
@pytest.mark.parametrize(
    "fn, maker",
    [
        ("chunk_precond_gated_delta_rule", "make_precond_gdn_inputs"),
        ("fused_recurrent_precond_gated_delta_rule", "make_precond_gdn_inputs"),
        ("chunk_precond_kda", "make_precond_kda_inputs"),
        ("fused_recurrent_precond_kda", "make_precond_kda_inputs"),
    ],
)
def test_fla_precond_adapters_refuse_non_bool_flags(fn, maker, flag, without_runtime_typecheck):
    from deltanet_cp.interop import fla
    from tests import helpers

    args = getattr(helpers, maker)(0, t=8, dk=4, dv=4)[0]
    if fn == "fused_recurrent_precond_gated_delta_rule":  # FLA's order: q k v g gk gv beta
        q, k, v, g_atk, g, beta_atk, beta = args
        call = ft.partial(getattr(fla, fn), q, k, v, g, None, None, beta, g_atk, beta_atk)
    else:
        call = ft.partial(getattr(fla, fn), *args)
    with pytest.raises(ValueError, match=f"`{flag}` must be True or False; got 'no'"):
        call(initial_state=jnp.zeros((1, 2, 4, 4)), **{flag: "no"})


def test_fla_chunk_precond_kda_takes_use_qk_l2norm_in_kernel(without_runtime_typecheck):
    # FLA's function takes it (in its **kwargs) and always normalises q and k.
    from deltanet_cp.interop import fla
    from tests import helpers

    args = helpers.make_precond_kda_inputs(0, t=8, dk=4, dv=4)[0]
    o, _, _ = fla.chunk_precond_kda(*args, chunk_size=4)
    o_true, _, _ = fla.chunk_precond_kda(*args, use_qk_l2norm_in_kernel=True, chunk_size=4)
    assert np.array_equal(o, o_true)
    with pytest.raises(ValueError, match="always L2-normalises"):
        fla.chunk_precond_kda(*args, use_qk_l2norm_in_kernel=False)
    with pytest.raises(ValueError, match="`use_qk_l2norm_in_kernel` must be True or False"):
        fla.chunk_precond_kda(*args, use_qk_l2norm_in_kernel="no")  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("fn", ["chunk_precond_gated_delta_rule", "chunk_precond_kda"])
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(log_atk_scale=1e39), "`log_atk_scale` must be finite"),  # inf in float32
        (dict(log_atk_scale=float("inf")), "`log_atk_scale` must be finite"),
        (dict(log_atk_scale=float("nan")), "`log_atk_scale` must be finite"),
        (dict(log_atk_scale=jnp.array([0.0, jnp.nan])), "`log_atk_scale` must be finite"),
        (dict(eps=1e-39), "`eps` must be between float32's smallest normal"),
        (dict(eps=1e-45), "`eps` must be between float32's smallest normal"),
    ],
)
def test_precond_center_and_eps(fn, kwargs, match, without_runtime_typecheck):
    maker = "gdn" if fn == "chunk_precond_gated_delta_rule" else "kda"
    from tests import helpers

    args = getattr(helpers, f"make_precond_{maker}_inputs")(0, b=1, t=8, h=2, hv=2, dk=4, dv=4)[0]
    with pytest.raises(ValueError, match=match):
        getattr(dcp, fn)(*args, **kwargs)


def _gdn_check_case(b=1):
    q, k, v, g, beta = _family_args("gated_delta_rule")
    inputs = dcp.DeltaInputs(q[:b], k[:b], v[:b], g[:b], beta[:b])
    return dcp.GatedDeltaRule(chunk_size=4), inputs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(cp=(0,)), r"`cp` must hold device counts, ints >= 1"),
        (dict(cp=(2, True)), r"`cp` must hold device counts"),
        (dict(cp=2), r"`cp` must be a sequence of device counts"),
        (dict(layouts=()), r"layouts=\(\) with cp=\(2, 4\) would check no context parallelism"),
        (dict(layouts=("zigzag",)), r"`layouts` must hold deltanet_cp.AbstractLayout"),
        (dict(gradients="no"), r"`gradients` must be True or False"),
        (dict(rtol=float("nan")), r"`rtol` must be a finite number >= 0"),
        (dict(atol=float("inf")), r"`atol` must be a finite number >= 0"),
        (dict(rtol=-1e-4), r"`rtol` must be a finite number >= 0"),
        (dict(seed=-1), r"`seed` must be an int >= 0"),
        (dict(exchange="rings"), r"Unknown exchange 'rings'"),
        (dict(unchunked=dcp.GatedDeltaRule(chunk_size=4)), r"`unchunked` must be .* chunk_size=1"),
    ],
)
def test_check_recurrence_arguments(kwargs, match, without_runtime_typecheck):
    from deltanet_cp.testing import check_recurrence

    recurrence, inputs = _gdn_check_case()
    with pytest.raises(ValueError, match=match):
        check_recurrence(recurrence, inputs, **kwargs)


def test_check_recurrence_refuses_an_empty_batch():
    from deltanet_cp.testing import check_recurrence

    recurrence, inputs = _gdn_check_case(b=0)
    with pytest.raises(ValueError, match="at least one batch row"):
        check_recurrence(recurrence, inputs, cp=())


def test_one_count_of_the_recurrences():
    # The docs name one number of recurrences: the rows of the API overview's table ("two
    # recurrences" is a preconditioned rule's cascade).
    root = Path(__file__).parent.parent
    table = (root / "docs" / "api" / "index.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| [") and "chunk_" in ln]
    words = {10: "ten"}
    assert len(rows) == 10, rows
    pages = [root / "README.md", root / "mkdocs.yml", *sorted((root / "docs").rglob("*.md"))]
    counts = set()
    for page in pages:
        for word in re.findall(r"\b(\w+) recurrences\b", page.read_text(), flags=re.IGNORECASE):
            if word.lower() in ("three", "four", "five", "six", "seven", "eight", "nine"):
                counts.add((page.name, word.lower()))
            if word.lower() in ("ten", "eleven", "twelve"):
                assert word.lower() == words[len(rows)], (page, word)
    assert not counts, f"pages counting the recurrences otherwise: {sorted(counts)}"


def test_mesh_context_parallel_inside_shard_map(without_runtime_typecheck):
    # A `mesh=` ContextParallel (global arrays, its own shard_map) called inside the user's
    # shard_map over its axis: a ValueError saying to drop the mesh there, not JAX's "should
    # be of type Manual" (traced only).
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,))
    cp = dcp.ContextParallel("cp", mesh=mesh)
    x = jnp.ones((1, 16, 1, 8))

    def local(q):
        return dcp.chunk_gated_delta_rule(q, q, q, q[..., 0] * 0, q[..., 0] * 0, cp=cp)[0]

    f = jax.shard_map(local, mesh=mesh, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    with pytest.raises(ValueError, match=r"already inside one over 'cp'.*without `mesh`"):
        jax.eval_shape(f, x)

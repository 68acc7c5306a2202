"""The momentum delta rule's public layout: flash-linear-attention's stacked `(2, N, HV, K, V)`
state and its defaults (`p = k`, `beta = eta = 1`, the probe times alpha; q/k/p
L2-normalised on request, FLA's default), against the float64 loop; and the errors its
arguments get. The property tests of tests/test_recurrences.py (through `tests/registry.py`)
cover everything else.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltanet_cp as dcp

from .helpers import make_momentum_inputs, momentum_reference, rel_err, split_momentum_state


pytestmark = pytest.mark.usefixtures("fast_compile")


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_fla_defaults_and_stacked_state(fn):
    # Only the positional (q, k, v, log_alpha, log_mu): p = k, beta = eta = 1, and FLA's
    # default use_p_times_alpha = True; FLA's use_qk_l2norm_in_kernel = True asked for.
    (q, k, v, la, lm, *_), h0 = make_momentum_inputs(1, b=2, t=21, h=1, hv=2)
    stacked = jnp.asarray(split_momentum_state(h0))
    call = (
        jax.jit(
            lambda *a: dcp.chunk_momentum_delta_rule(
                *a[:-1], initial_state=a[-1], chunk_size=8, use_qk_l2norm=True
            )
        )
        if fn == "chunk"
        else jax.jit(
            lambda *a: dcp.recurrent_momentum_delta_rule(
                *a[:-1], initial_state=a[-1], use_qk_l2norm=True
            )
        )
    )
    o, final = call(q, k, v, la, lm, stacked)
    expected_o, expected_h = momentum_reference(
        q, k, v, la, lm, initial_state=h0, l2norm=True, p_times_alpha=True
    )
    assert final.shape == (2, 2, 2, 8, 6) and final.dtype == jnp.float32
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(final, split_momentum_state(expected_h)) <= 1e-5


def test_options_and_packed_documents():
    # The probe without alpha, no normalisation, and two packed documents with their own
    # stacked states (2, N, HV, K, V).
    cu = [0, 13, 40]
    args, _ = make_momentum_inputs(2, b=1, t=40, h=1, hv=2)
    rng = np.random.default_rng(3)
    docs = rng.normal(size=(2, 2, 16, 6))  # (N, HV, 2K, V)
    kw = dict(use_qk_l2norm=False, use_p_times_alpha=False, cu_seqlens=cu, chunk_size=8)
    o, finals = dcp.chunk_momentum_delta_rule(
        *args, initial_state=jnp.asarray(split_momentum_state(docs), jnp.float32), **kw
    )
    expected_o, expected_h = momentum_reference(
        *args, initial_state=docs, l2norm=False, p_times_alpha=False, cu_seqlens=cu
    )
    assert finals.shape == (2, 2, 2, 8, 6)
    assert rel_err(o, expected_o) <= 1e-5
    assert rel_err(finals, split_momentum_state(expected_h)) <= 1e-5


def test_clear_errors(without_runtime_typecheck):
    # The errors a user gets without jaxtyping's runtime checks (which catch some first).
    args, h0 = make_momentum_inputs(4, b=1, t=10, h=1, hv=2)
    joint = jnp.asarray(h0)  # (B, HV, 2K, V): the engine's layout, not the public one
    with pytest.raises(ValueError, match=r"initial_state.*\(2, B, HV, K, V\)"):
        dcp.chunk_momentum_delta_rule(*args, initial_state=joint)
    with pytest.raises(ValueError, match=r"initial_state.*\(2, N documents, HV, K, V\)"):
        dcp.chunk_momentum_delta_rule(
            *args, initial_state=jnp.asarray(split_momentum_state(h0)), cu_seqlens=[0, 4, 10]
        )
    with pytest.raises(ValueError, match="use_p_times_alpha"):
        dcp.chunk_momentum_delta_rule(*args, use_p_times_alpha="yes")  # pyright: ignore[reportArgumentType]
    q, k, v, la, lm, p, beta, eta = args
    with pytest.raises(ValueError, match="`log_mu`"):
        dcp.chunk_momentum_delta_rule(q, k, v, la, lm[..., :1], p, beta, eta)
    with pytest.raises(ValueError, match="`p`"):
        dcp.chunk_momentum_delta_rule(q, k, v, la, lm, p[..., :-1], beta, eta)
    with pytest.raises(ValueError, match="`eta`"):
        dcp.chunk_momentum_delta_rule(q, k, v, la, lm, p, beta, eta[:, :-1])

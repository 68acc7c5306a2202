"""Kimi Delta Attention's gates, shared by [`deltanet_cp.nn.KimiDeltaAttention`][] and
[`deltanet_cp.nn.PrecondKimiDeltaAttention`][]: its projections (a low-rank forget gate per
head and key channel, a step size per head, a low-rank output gate) and how the
convolution's output and those projections become the delta rule's inputs."""

import jax
from jaxtyping import Array

from ..recurrences._delta_family import DeltaInputs
from ._delta_layer import log_decay, one_sequence, project, split_qkv


def kda_project(layer, x):
    """Kimi Delta Attention's projections of `x: (seq, hidden)` (those of `layer`, which has
    its fields): `(qkv (seq, 3 H K), (f, b, gate))`."""
    qkv, f, b, gate = project(x, layer.in_proj_qkv, layer.f_a_proj, layer.b_proj, layer.g_a_proj)
    (f,) = project(f, layer.f_b_proj)
    (gate,) = project(gate, layer.g_b_proj)
    return qkv, (f, b, gate)


def kda_split(layer, mixed, rest) -> tuple[DeltaInputs, Array]:
    """Kimi Delta Attention's recurrence inputs (a batch of one) and output gate from the
    convolution's output after SiLU, `(seq, 3 H K)`, and the rest of `kda_project`."""
    f, b, gate = rest
    h, dk = layer.num_heads, layer.head_dim
    q, k, v = split_qkv(mixed, h, dk, dk)
    g = log_decay(f.reshape(v.shape), layer.A_log[None, :, None], layer.dt_bias[None])
    return one_sequence(DeltaInputs, q, k, v, g, jax.nn.sigmoid(b)), gate.reshape(v.shape)

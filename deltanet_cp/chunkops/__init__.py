r"""Building blocks for the chunked form of a linear recurrence: the pieces every recurrence
of the library is made of, for writing your own (see *Adding your own recurrence*).

A recurrence's `prepare` gets a block of chunks `(B, N, C, *heads, *features)`;
[`chunk_major`][deltanet_cp.chunkops.chunk_major] puts the chunk index first and the
position in the chunk just before the features, `(N, B, *heads, C, *features)`, so that
everything below is a batched product over the leading axes. With log decays $g_t \le 0$
and $G_i = \sum_{t \le i} g_t$ from the chunk start:

- the decays into and out of the chunk, $e^{G_i}$ and $e^{G_C - G_i}$:
    [`cumulative_decays`][deltanet_cp.chunkops.cumulative_decays];
- the decays from the chunk start to just before each token, $e^{G_{i-1}}$:
    [`exclusive_decays`][deltanet_cp.chunkops.exclusive_decays];
- the decays between two tokens, $G_i - G_j$: [`segment_sums`][deltanet_cp.chunkops.segment_sums],
    and $e^{G_i - G_j}$ masked to $i \ge j$: [`decay_matrix`][deltanet_cp.chunkops.decay_matrix];
- the decayed products of two sets of rows,
    $\sum_c x_{ic} y_{jc} e^{G_{ic} - G_{jc}}$: [`decayed_gram`][deltanet_cp.chunkops.decayed_gram]
    (per-head or per-channel decays), [`decayed_grams`][deltanet_cp.chunkops.decayed_grams]
    (several of them under one per-channel decay);
- the WY form's $(I + A)^{-1}$ for a strictly lower-triangular $A$:
    [`unit_lower_inverse`][deltanet_cp.chunkops.unit_lower_inverse].

**Numerics.** None of them forms $e^{G_i} / e^{G_j}$ (it overflows for strong decays) nor
$G_i - G_j$ as a difference of cumulative sums (a strong decay early in a chunk leaves an
absolute error $\epsilon |G_j|$ in every later exponent, a relative error in every later
decay): every exponent is a sum of gates of one sign over its own segment, accurate to a
relative $\epsilon$ times the segment's length, and every decay is at most 1. So they are
exact, to float32 rounding, for any gates, including $-\infty$ (a decay of exactly zero);
products run at `Precision.HIGHEST` by default (float32 products and sums stay float32 on
GPUs and TPUs too). Cast inputs to float32 (or float64) first: in bfloat16 they are no more
exact than bfloat16. The products of rows (`decayed_gram`, `decayed_grams`,
`unit_lower_solve`, [`einsum`][deltanet_cp.chunkops.einsum]) take a `precision`:
`"bfloat16"` rounds their operands to bfloat16 and accumulates in float32, forward and VJP
(the recurrences' policy for bfloat16 inputs); the decays and their sums, and the inverse
of `unit_lower_inverse`, stay in the inputs' dtype at `Precision.HIGHEST` whatever it is.
"""

from .._precision import einsum as einsum
from ._decays import (
    cumsum as cumsum,
    cumulative_decays as cumulative_decays,
    decay_matrix as decay_matrix,
    decayed_gram as decayed_gram,
    decayed_grams as decayed_grams,
    exclusive_decays as exclusive_decays,
    segment_sums as segment_sums,
)
from ._ops import (
    chunk_major as chunk_major,
    from_chunk_major as from_chunk_major,
    l2norm as l2norm,
    unit_lower_inverse as unit_lower_inverse,
    unit_lower_solve as unit_lower_solve,
)


__all__ = [
    "chunk_major",
    "cumsum",
    "cumulative_decays",
    "decay_matrix",
    "decayed_gram",
    "decayed_grams",
    "einsum",
    "exclusive_decays",
    "from_chunk_major",
    "l2norm",
    "segment_sums",
    "unit_lower_inverse",
    "unit_lower_solve",
]

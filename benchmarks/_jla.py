"""Load jax-linear-attention's plain-JAX chunked path and its context parallelism.

jax-linear-attention (`jla`, 0.1.0; a peer we measure against, never a dependency) is a
JAX + Equinox training template whose wheel is pure Python and declares Python >= 3.12.
We use two of its modules and nothing else:

- `jla.ops.chunked`: `gated_delta_rule(q, k, v, g, beta, *, scale, initial_state,
  output_final_state, cu_seqlens, segment_ids, use_qk_l2norm, chunk_size)`, plain JAX
  (q and k with as many heads as v);
- `jla.distributed.context_parallel`: `context_parallel_linear_attention(kind, q, k, v,
  *, mesh, axis, ...)`, the sequence sharded over a mesh axis.

Its Mosaic GPU kernels (`jla.ops.mosaic_gpu`) are never imported: importing
`jla.ops` does not load them (only `jla.ops.available` and `linear_attention` do, and we
call neither), and `load_jla` checks that they stayed out. `make bench` installs the wheel
with `pip install --no-deps --ignore-requires-python`; without that, `load_jla` unpacks a
`jax_linear_attention-*.whl` found in `wheels` (or `.venv-bench/wheels`) into a temporary
directory on `sys.path`. Its chunked path calls `jax.scipy.linalg.solve_triangular`,
which can deadlock on XLA:CPU: time it through `_harness.py`, which reports hangs.
"""

import glob
import importlib
import os
import sys
import tempfile
import types
import zipfile


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_wheel(directory: str | None) -> str | None:
    """The newest-named `jax_linear_attention-*.whl` in `directory`, or None."""
    if not directory:
        return None
    wheels = sorted(glob.glob(os.path.join(directory, "jax_linear_attention-*.whl")))
    return wheels[-1] if wheels else None


def load_jla(wheels: str | None = None) -> types.SimpleNamespace:
    """`jla.ops.chunked` and `jla.distributed.context_parallel`, and the version.

    **Arguments:**

    - `wheels`: a directory holding a `jax_linear_attention-*.whl`, used when `jla` is not
      importable (`.venv-bench/wheels` is tried too).

    **Returns:** a namespace with `chunked`, `context_parallel`, `version` and `where`.
    """
    try:
        importlib.import_module("jla")
    except ImportError:
        wheel = find_wheel(wheels) or find_wheel(os.path.join(ROOT, ".venv-bench", "wheels"))
        if wheel is None:
            raise ImportError("jla is not installed and no jax_linear_attention wheel found")
        target = tempfile.mkdtemp(prefix="bench-jla-")
        with zipfile.ZipFile(wheel) as z:
            z.extractall(target)
        sys.path.insert(0, target)
    jla = importlib.import_module("jla")
    chunked = importlib.import_module("jla.ops.chunked")
    context_parallel = importlib.import_module("jla.distributed.context_parallel")
    loaded = [m for m in sys.modules if m.startswith("jla.ops.mosaic_gpu")]
    if loaded:
        raise RuntimeError(f"jla's Mosaic GPU kernels were imported: {loaded}")
    return types.SimpleNamespace(
        chunked=chunked,
        context_parallel=context_parallel,
        version=getattr(jla, "__version__", "?"),
        where=os.path.dirname(os.path.dirname(jla.__file__)),
    )

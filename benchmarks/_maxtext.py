"""Load MaxText's JAX gated delta rule without importing the `maxtext` package.

MaxText (`pip install maxtext`, a peer we measure against, never a dependency) keeps its
chunked gated delta rule in `maxtext/models/qwen3.py` and the context-parallel composition
in `maxtext/kernels/attention/gdn_cp.py`. Importing `maxtext.models.qwen3` pulls flax, its
layers and much more, so this module reads the source files instead (from the installed
package, found without running its `__init__`, or straight out of a `maxtext-*.whl` zip),
takes `jax_chunk_gated_delta_rule` and the one helper it needs (`l2norm`, from
`maxtext/layers/normalizations.py`) out of them with `ast`, and runs just those definitions
in a namespace holding `jax`, `jnp`, `lax` and `gdn_cp`. `gdn_cp.py` imports nothing but
jax, so it runs whole, as a module of its own. Nothing of MaxText is copied into this
repository: the code is read from the installed files at run time.

The wheel declares `Requires-Python >= 3.12`; on an older Python install it with
`pip install --no-deps --ignore-requires-python maxtext-0.2.5-py3-none-any.whl` (the files
we read run on 3.11), or pass the wheel file itself to `load_maxtext(wheel=...)`.
"""

import __future__

import ast
import builtins
import glob
import importlib.util
import os
import types
import zipfile

import jax
import jax.numpy as jnp
from jax import lax


QWEN3 = "maxtext/models/qwen3.py"
NORMS = "maxtext/layers/normalizations.py"
GDN_CP = "maxtext/kernels/attention/gdn_cp.py"


def _installed_root() -> str | None:
    """Directory holding the installed `maxtext` package, or None (its `__init__` not run)."""
    try:
        spec = importlib.util.find_spec("maxtext")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.dirname(list(spec.submodule_search_locations)[0])


def find_wheel(directory: str) -> str | None:
    """The newest-named `maxtext-*.whl` in `directory`, or None."""
    wheels = sorted(glob.glob(os.path.join(directory, "maxtext-*.whl")))
    return wheels[-1] if wheels else None


def _reader(wheel: str | None):
    """`(read(path) -> source, where)` over the installed package or a wheel file."""
    if wheel is None:
        root = _installed_root()
        if root is None:
            raise ImportError("maxtext is not installed (and no maxtext wheel was given)")

        def read(path):
            with open(os.path.join(root, path), encoding="utf-8") as f:
                return f.read()

        return read, os.path.join(root, "maxtext")
    archive = zipfile.ZipFile(wheel)
    return lambda path: archive.read(path).decode("utf-8"), wheel


def _version(read) -> str:
    try:
        scope: dict = {}
        exec(read("maxtext/version.py"), scope)
        return str(scope.get("__version__", "?"))
    except Exception:
        return "?"


def _functions(source: str, filename: str, names: list[str], scope: dict) -> None:
    """Run the top-level `def`s called `names` of `source` in `scope` (annotations lazy)."""
    tree = ast.parse(source, filename)
    nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    missing = set(names) - {n.name for n in nodes}
    if missing:
        raise ImportError(f"{filename} has no top-level {sorted(missing)}")
    module = ast.Module(body=nodes, type_ignores=[])
    flags = __future__.annotations.compiler_flag  # `query: Array` etc. are never evaluated
    exec(compile(module, filename, "exec", flags=flags, dont_inherit=True), scope)
    # Fail here, not at the first call, if a name the functions read is not in `scope`.
    for node in nodes:
        local = {a.arg for a in ast.walk(node) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.ctx != ast.Load()}
        local |= {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}
        free = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.ctx == ast.Load()}
        unknown = free - local - set(scope) - set(dir(builtins))
        if unknown:
            raise ImportError(f"{filename}:{node.name} needs {sorted(unknown)}, not provided")


def load_maxtext(wheel: str | None = None) -> types.SimpleNamespace:
    """MaxText's `jax_chunk_gated_delta_rule` (and its `gdn_cp` module), read from source.

    **Arguments:**

    - `wheel`: a `maxtext-*.whl` file to read from; None reads the installed package.

    **Returns:** a namespace with `jax_chunk_gated_delta_rule`, `gdn_cp`, `version` and
    `where` (the directory or wheel read).
    """
    read, where = _reader(wheel)
    gdn_cp = types.ModuleType("maxtext_gdn_cp")  # not `maxtext.…`: nothing is registered
    gdn_cp.__file__ = os.path.join(where, GDN_CP.removeprefix("maxtext/"))
    exec(compile(read(GDN_CP), gdn_cp.__file__, "exec", dont_inherit=True), gdn_cp.__dict__)
    scope = {"jax": jax, "jnp": jnp, "lax": lax, "Array": jax.Array, "gdn_cp": gdn_cp}
    _functions(read(NORMS), os.path.join(where, NORMS), ["l2norm"], scope)
    _functions(read(QWEN3), os.path.join(where, QWEN3), ["jax_chunk_gated_delta_rule"], scope)
    return types.SimpleNamespace(
        jax_chunk_gated_delta_rule=scope["jax_chunk_gated_delta_rule"],
        gdn_cp=gdn_cp,
        version=_version(read),
        where=where,
    )

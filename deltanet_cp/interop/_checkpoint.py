"""Hugging Face checkpoints in the safetensors format: the one room that reads them, for every
layer and model loader (and the place to write them).

- The format: an 8-byte little-endian header length, a JSON object mapping each tensor's name
    to its `dtype`, `shape` and `data_offsets` (from the end of the header), then the bytes.
    Read with numpy and `ml_dtypes` only (never pickle): the `safetensors` package's numpy
    reader refuses bfloat16, the dtype most checkpoints are stored in.
- `Checkpoint`: the tensors of a file, of a folder, or of a sharded checkpoint's
    `model.safetensors.index.json`, by name; headers are read on opening, values when asked.
- One rule for the files: the **names** a checkpoint gives (the index's `weight_map`) are
    confined to its folder: a `.safetensors` file name, no absolute path, no `..`, no other
    folder. A file in the folder may be a link to anywhere, and is followed: in the Hugging
    Face cache, `snapshots/<rev>/*.safetensors` link to `../../blobs/<sha>`.
- What the layer loaders share: config fields, the layer's prefix, and its tensors by short
    name with their shapes and dtypes checked.
"""

import itertools
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .._validate import as_config_float, as_config_int


INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# ---------------------------------------------------------------------------------------
# The format
# ---------------------------------------------------------------------------------------


class TensorInfo:
    """Where one tensor lies in a file: its name, dtype (the format's, e.g. `"BF16"`), shape
    and byte range."""

    def __init__(
        self, file: Path, name: str, dtype: str, shape: tuple[int, ...], start: int, end: int
    ):
        self.file, self.name, self.dtype, self.shape = file, name, dtype, shape
        self.start, self.end = start, end

    @property
    def floating(self) -> bool:
        """Whether the tensor is floating-point (F64 ... F8, BF16)."""
        return self.dtype.startswith(("F", "BF"))


def _corrupt(file: Path, what: str) -> ValueError:
    return ValueError(f"The safetensors file {str(file)!r} is corrupt ({what}). Download it again.")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(file: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one `.safetensors` file, by name (nothing is read but the header).

    A `ValueError` naming the file (and the tensor) if the header is not what the format
    says: a JSON object of entries with a known `dtype`, a `shape` of sizes and
    `data_offsets` that tile the data within the file.
    """
    file = Path(file)
    try:
        with open(file, "rb") as f:
            head = f.read(8)
            size = int.from_bytes(head, "little")
            length = os.fstat(f.fileno()).st_size
            if len(head) < 8 or size > length - 8:
                raise _corrupt(file, f"its {length} bytes hold no header of {size} bytes")
            text = f.read(size)
    except OSError as e:
        raise ValueError(f"Cannot read the safetensors file {str(file)!r}: {e}") from None
    try:
        header = json.loads(text)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON
        raise _corrupt(file, f"its header: {type(e).__name__}: {e}") from None
    if not isinstance(header, dict):
        raise _corrupt(file, f"its header is a JSON {type(header).__name__}, not an object")
    base = 8 + size
    out = {}
    for name, entry in header.items():
        if name != "__metadata__":
            out[name] = _entry(file, name, entry, base)
    _check_ranges(file, out, base, length)
    return out


def _entry(file: Path, name: str, entry: Any, base: int) -> TensorInfo:
    """One tensor's header entry, checked: a `ValueError` naming the tensor, its file and the
    field that is wrong."""
    where = f"Tensor {name!r} of the safetensors file {str(file)!r}"
    corrupt = "the file is corrupt; download it again."
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise ValueError(
            f"{where} has the header entry {entry!r}; expected an object with `dtype`, "
            f"`shape` and `data_offsets`: {corrupt}"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"{where} has unsupported dtype {dtype!r} (read: {', '.join(DTYPES)}).")
    if not isinstance(shape, list) or not all(_is_int(n) and n >= 0 for n in shape):
        raise ValueError(f"{where} has shape {shape!r}, not a list of sizes: {corrupt}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(n) and n >= 0 for n in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(
            f"{where} has data_offsets {offsets!r}; expected [begin, end], two byte offsets "
            f"with 0 <= begin <= end: {corrupt}"
        )
    begin, end = offsets
    size = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if end - begin != size:
        raise ValueError(
            f"{where} has data_offsets {offsets}, {end - begin} bytes, where its shape "
            f"{tuple(shape)} and dtype {dtype} take {size}: {corrupt}"
        )
    return TensorInfo(file, name, dtype, tuple(shape), base + begin, base + end)


def _check_ranges(file: Path, tensors: dict[str, TensorInfo], base: int, length: int) -> None:
    """The tensors' byte ranges tile the data from its start, in some order, as the format
    requires (the `safetensors` package refuses the same files): no two share a byte, no
    bytes are left between them, and the last ends within the file."""
    at, before = base, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end)):
        if info.start < at:
            raise _corrupt(
                file, f"tensors {before!r} and {name!r} share bytes: their data_offsets overlap"
            )
        if info.start > at:
            raise _corrupt(file, f"the bytes before tensor {name!r} belong to no tensor (a hole)")
        if info.end > length:
            raise ValueError(
                f"Tensor {name!r} of the safetensors file {str(file)!r} lies at bytes "
                f"[{info.start}, {info.end}), past the file's {length} bytes: the file is "
                "truncated or corrupt. Download it again."
            )
        at, before = info.end, name


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's values, as a numpy array (bfloat16 as `ml_dtypes.bfloat16`)."""
    dtype = np.dtype(DTYPES[info.dtype])
    if info.end == info.start:
        return np.zeros(info.shape, dtype)
    try:
        with open(info.file, "rb") as f:
            f.seek(info.start)
            data = f.read(info.end - info.start)
        return np.frombuffer(data, dtype).reshape(info.shape).copy()
    except (OSError, ValueError) as e:  # a file changed or cut since its header was read
        raise ValueError(
            f"Cannot read tensor {info.name!r} of the safetensors file {str(info.file)!r}: {e}"
        ) from None


# ---------------------------------------------------------------------------------------
# Checkpoints: files, folders, indices
# ---------------------------------------------------------------------------------------


class Checkpoint(Mapping[str, np.ndarray]):
    """Tensors by name from safetensors files: the headers read on opening, each tensor's
    values when it is asked for.

    A name found in several files (a folder read without its index) must have the same
    values in all of them.
    """

    def __init__(self, tensors: Mapping[str, Sequence[TensorInfo]]):
        self._tensors = dict(tensors)

    @classmethod
    def from_files(cls, files: Sequence[Path]) -> "Checkpoint":
        """Every tensor of `files`."""
        tensors: dict[str, list[TensorInfo]] = {}
        for file in files:
            for name, info in read_header(file).items():
                tensors.setdefault(name, []).append(info)
        return cls(tensors)

    @classmethod
    def from_index(cls, index: Path) -> "Checkpoint":
        """The tensors an index (`model.safetensors.index.json`) lists, each from the file its
        `weight_map` names: a file in the index's folder (followed if it is a link)."""
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"Cannot read the `weight_map` of the index {str(index)!r}: {e!r}."
            ) from None
        if not isinstance(weight_map, Mapping):
            raise ValueError(
                f"The `weight_map` of {str(index)!r} must map tensor names to file names; got "
                f"{type(weight_map).__name__}."
            )
        files = {name: shard(index, name, file) for name, file in weight_map.items()}
        headers = {f: read_header(f) for f in sorted(set(files.values()))}
        absent = [f"{n!r} is not in {str(f)!r}" for n, f in files.items() if n not in headers[f]]
        if absent:
            raise ValueError(
                f"The index {str(index)!r} lists tensors its files lack: {'; '.join(absent)}."
            )
        return cls({n: [headers[f][n]] for n, f in files.items()})

    def info(self, name: str) -> TensorInfo:
        """Where `name` lies (in its first file): its dtype and shape, without reading it."""
        return self._tensors[name][0]

    def __getitem__(self, name: str) -> np.ndarray:
        first, *others = self._tensors[name]
        x = read_tensor(first)
        for other in others:
            y = read_tensor(other)
            if x.dtype != y.dtype or x.shape != y.shape or not np.array_equal(x, y):
                raise ValueError(
                    f"Tensor {name!r} is in both {first.file.name!r} and {other.file.name!r}, "
                    "with different values: remove the stale file, or add the checkpoint's "
                    f"`{INDEX}` (which says which file holds each tensor)."
                )
        return x

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def shard(index: Path, name: Any, file: Any) -> Path:
    """The file of one `weight_map` entry: a `.safetensors` file name in the index's folder
    (no absolute path, `..` or other folder). The file may be a link, to anywhere."""
    if not isinstance(name, str) or not isinstance(file, str):
        raise ValueError(
            f"The `weight_map` of {str(index)!r} must map tensor names to file names; it maps "
            f"{name!r} to {file!r}."
        )
    if (
        Path(file).name != file
        or any(sep in file for sep in (os.sep, os.altsep) if sep)
        or not file.endswith(".safetensors")
    ):
        raise ValueError(
            f"The index {str(index)!r} puts {name!r} in {file!r}: expected the name of a "
            "`.safetensors` file in the checkpoint folder (no absolute path, `..` or other "
            "folder; the file itself may be a link, as in the Hugging Face cache)."
        )
    path = index.parent / file
    if not path.is_file():
        raise FileNotFoundError(
            f"The index {str(index)!r} puts {name!r} in {file!r}, which does not exist"
            f"{' (a broken link)' if path.is_symlink() else ''}."
        )
    return path


def open_weights(weights: Any) -> Mapping[str, Any]:
    """A layer loader's `weights`: a mapping from names to arrays as it is, or the path of a
    `.safetensors` file, of an index, or of a folder (read through its index if it has one,
    else every `.safetensors` file in it)."""
    if isinstance(weights, Mapping):
        return weights
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(
            "`weights` must be a mapping from tensor names to arrays, or the path of a "
            f"`.safetensors` file or of a directory of them; got {type(weights).__name__}."
        )
    path = Path(weights)
    if path.is_dir() and (path / INDEX).is_file():
        return Checkpoint.from_index(path / INDEX)
    if path.name.endswith(".safetensors.index.json"):
        return Checkpoint.from_index(path)
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"No `.safetensors` files in the directory {str(path)!r}.")
        return Checkpoint.from_files(files)
    if path.suffix == ".safetensors":
        if not path.exists():
            raise FileNotFoundError(f"No such weights file: {str(path)!r}.")
        return Checkpoint.from_files([path])
    raise ValueError(
        f"Only safetensors checkpoints are read (never pickle); got {str(path)!r}. "
        "Convert it to `.safetensors` first, or pass a mapping of arrays."
    )


def open_folder(path: Path) -> Checkpoint:
    """A model's checkpoint folder: its `model.safetensors.index.json` and the files it
    names, or its `model.safetensors`."""
    index, single = path / INDEX, path / SINGLE
    if index.exists():
        return Checkpoint.from_index(index)
    if single.exists():
        return Checkpoint.from_files([single])
    found = sorted(p.name for p in path.iterdir())
    pickled = [f for f in found if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = (
        f" It holds {pickled}: pickle-based checkpoints are never read; convert them to "
        "safetensors first."
        if pickled
        else ""
    )
    raise ValueError(f"No {SINGLE} or {INDEX} in {str(path)!r} (found {found}).{hint}")


# ---------------------------------------------------------------------------------------
# What the layer loaders share: config fields, a layer's tensors
# ---------------------------------------------------------------------------------------


def config_value(config: Any, name: str, default: Any = None) -> Any:
    """A field of a config: a mapping, or an object with attributes (a transformers config)."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def config_int(config: Any, name: str, default: Any = None) -> int:
    """A positive int field of the config (`as_config_int`: an int or a NumPy integer)."""
    return as_config_int(name, config_value(config, name, default))


def config_float(config: Any, name: str, default: float) -> float:
    """A float field of the config: a number (an int too), never a bool or a string."""
    return as_config_float(name, config_value(config, name, default))


def text_config(config: Any) -> Any:
    """The language model's config: Qwen3.5's top-level config nests it in `text_config`."""
    if config_value(config, "hidden_size") is None:
        nested = config_value(config, "text_config")
        if nested is not None:
            return nested
    return config


def check_dtype(dtype) -> None:
    """A `ValueError` naming `dtype` unless it is `None` or a floating-point dtype."""
    if dtype is None:
        return
    try:
        floating = jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:
        floating = False
    if not floating:
        raise ValueError(
            f"`dtype` must be a floating-point dtype (jnp.float32, jnp.bfloat16, ...) or "
            f"None; got {dtype!r}."
        )


def find_prefix(
    tensors: Mapping[str, Any],
    prefix: str | None,
    markers: tuple[str, ...] = ("A_log",),
    what: str = "Gated DeltaNet",
) -> str:
    """`prefix`, or the one prefix in front of a tensor named by one of `markers`."""
    if prefix is not None:
        return prefix
    found = set()
    for name in tensors.keys():
        marker = next((m for m in markers if name.endswith(m)), None)
        if marker is not None:
            found.add(name[: -len(marker)])
    candidates = sorted(found)
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"No {what} weights found: expected a tensor named `{markers[0]}` (optionally "
            "behind a prefix such as `model.layers.0.linear_attn.`)."
        )
    raise ValueError(
        f"The weights hold {len(candidates)} {what} layers ({candidates[:4]}"
        f"{' ...' if len(candidates) > 4 else ''}); pass `prefix=` to choose one."
    )


def check_unexpected(
    tensors: Mapping[str, Any], prefix: str, allowed: tuple[str, ...], what: str
) -> None:
    """A `ValueError` naming the tensors behind `prefix` that are not in `allowed`."""
    names = [n for n in tensors.keys() if n.startswith(prefix)]
    unexpected = sorted(n for n in names if n[len(prefix) :] not in allowed)
    if unexpected:
        raise ValueError(
            f"Unexpected tensor(s) {unexpected} for a {what} layer with prefix "
            f"{prefix!r}; expected only {list(allowed)} (in one of the two layouts)."
        )


def layer_tensors(
    tensors: Mapping[str, Any],
    prefix: str,
    shorts: tuple[str, ...],
    expected: Mapping[str, tuple[tuple[int, ...], ...]],
    layout: str,
    sizes: str,
    dtype,
) -> dict[str, Any]:
    """The tensors `prefix + short` for each of `shorts`, as JAX arrays in `dtype` (their own
    if `None`); a `ValueError` naming one that is missing, misshapen (its shape not one of
    `expected[short]`) or not floating-point."""
    out = {}
    for short in shorts:
        name = prefix + short
        if name not in tensors:
            raise ValueError(f"Missing tensor {name!r} ({layout} layout: {', '.join(shorts)}).")
        x = tensors[name]
        if tuple(x.shape) not in expected[short]:
            shapes = " or ".join(str(e) for e in expected[short])
            raise ValueError(
                f"Tensor {name!r} has shape {tuple(x.shape)}; expected {shapes} for this "
                f"config ({sizes})."
            )
        x = jnp.asarray(x)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(
                f"Tensor {name!r} has dtype {x.dtype}; the layer's weights must be "
                "floating-point (is the checkpoint quantised?)."
            )
        out[short] = x if dtype is None else x.astype(dtype)
    return out


# ---------------------------------------------------------------------------------------
# Writing: safetensors files, sharded checkpoint folders, atomically
# ---------------------------------------------------------------------------------------

_DTYPE_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
CONFIG = "config.json"
_SIZE_UNITS = {
    "GIB": 2**30,
    "MIB": 2**20,
    "KIB": 2**10,
    "GB": 10**9,
    "MB": 10**6,
    "KB": 10**3,
    "B": 1,
}


def dtype_name(dtype: Any) -> str:
    """The format's name of a numpy dtype (`"F32"`, `"BF16"`, ...)."""
    dtype = np.dtype(dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"The safetensors format has no dtype {dtype}; write one of "
            f"{', '.join(str(np.dtype(d)) for d in DTYPES.values())}."
        )
    return _DTYPE_NAMES[dtype]


def write_safetensors(
    file: str | os.PathLike,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    layout: Mapping[str, tuple[tuple[int, ...], Any]] | None = None,
) -> None:
    """Write one `.safetensors` file: the header (each tensor's `dtype`, `shape` and
    `data_offsets`, and `__metadata__` `{"format": "pt"}` as torch's writer gives it, padded
    with spaces to a multiple of 8 bytes), then the bytes (C order, little-endian), flushed
    to disk.

    **Arguments:**

    - `file`: the file to write.
    - `tensors`: a mapping from names to numpy arrays, written in its order; or, with
        `layout`, `(name, array)` pairs in `layout`'s order, each written as it comes (one
        tensor in memory at a time).
    - `layout`: every tensor's name, shape and numpy dtype, in order, when `tensors` is a
        stream; a pair that differs from it is an `AssertionError`.
    """
    plan: Mapping[str, tuple[tuple[int, ...], Any]]
    if layout is None:
        if not isinstance(tensors, Mapping):
            raise TypeError("`tensors` must be a mapping from names to arrays without `layout`.")
        arrays = {n: np.asarray(x) for n, x in cast(Mapping[str, Any], tensors).items()}
        plan = {n: (tuple(x.shape), x.dtype) for n, x in arrays.items()}
        pairs: Iterator[tuple[str, np.ndarray]] = iter(arrays.items())
    else:
        plan = layout
        pairs = iter(cast(Iterable[tuple[str, np.ndarray]], tensors))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, (shape, dtype) in plan.items():
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(shape),
            "data_offsets": [at, at + size],
        }
        at += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for want, (shape, dtype) in plan.items():
            name, x = next(pairs)
            x = np.ascontiguousarray(x)
            if name != want or x.shape != tuple(shape) or x.dtype != np.dtype(dtype):
                raise AssertionError(
                    f"Tensor {name!r} {x.shape} {x.dtype} where the layout has {want!r} "
                    f"{tuple(shape)} {np.dtype(dtype)}."
                )
            if x.dtype.byteorder == ">":
                x = x.astype(x.dtype.newbyteorder("<"))
            f.write(x.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())


def shard_size(max_shard_size: int | str) -> int:
    """`max_shard_size` in bytes: an int, or a string as transformers takes it (`"5GB"` is
    5 * 10**9 bytes, `"5GiB"` 5 * 2**30, and so for `MB`, `MiB`, `KB`, `KiB`)."""
    if isinstance(max_shard_size, (int, np.integer)) and not isinstance(max_shard_size, bool):
        size = int(max_shard_size)
    elif isinstance(max_shard_size, str):
        text = max_shard_size.strip().upper()
        unit = next((u for u in _SIZE_UNITS if text.endswith(u)), None)
        try:
            size = int(float(text[: -len(unit)] if unit else text) * _SIZE_UNITS[unit or "B"])
        except ValueError:
            size = 0
    else:
        size = 0
    if size <= 0:
        raise ValueError(
            f"`max_shard_size` must be a positive number of bytes, an int or a string such as "
            f'"5GB" or "500MiB"; got {max_shard_size!r}.'
        )
    return size


def plan_shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """The tensors (by name, in order, with their sizes in bytes) in files of at most
    `max_bytes` each, as transformers splits them: the next tensor starts a new file when it
    would not fit (a tensor larger than `max_bytes` gets a file of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def save_folder(
    path: str | os.PathLike,
    config: Mapping[str, Any],
    layout: Mapping[str, tuple[tuple[int, ...], Any]],
    tensors: Iterator[tuple[str, np.ndarray]],
    *,
    max_shard_size: int | str = "5GB",
    write: bool = True,
) -> None:
    """Write a checkpoint folder as transformers' `save_pretrained` does, atomically.

    `config.json`, and the tensors in files of at most `max_shard_size`: one
    `model.safetensors`, or `model-0000i-of-0000n.safetensors` with a
    `model.safetensors.index.json` (its `weight_map`, and `metadata.total_size`).

    Everything is written into a new folder beside `path` (`.<name>.saving-<id>`), each file
    flushed to disk, then renamed into place: a crash while writing leaves the old
    checkpoint as it was. An existing `path` is first renamed aside and removed after the
    new one is in place; its other files (a tokenizer, a README) are carried over (hard
    links where the file system allows), its checkpoint files (`config.json`,
    `*.safetensors`, the index) replaced.

    **Arguments:**

    - `path`: the checkpoint folder (created with its parents if absent).
    - `config`: the contents of `config.json`.
    - `layout`: every tensor's name, in order, with its shape and numpy dtype: how the files
        are split is planned from it before any tensor is computed.
    - `tensors`: `(name, array)` pairs in `layout`'s order, each written as it comes (one
        tensor in memory at a time).
    - `max_shard_size`: the most bytes in one file, an int or a string (`shard_size`).
    - `write`: `False` consumes `tensors` without writing anything (a process other than
        the one writing, whose gathers must still take part).
    """
    max_bytes = shard_size(max_shard_size)
    sizes = {
        name: math.prod(shape) * np.dtype(dtype).itemsize for name, (shape, dtype) in layout.items()
    }
    shards = plan_shards(sizes, max_bytes)
    n = len(shards)
    files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    path = Path(path)
    if path.is_symlink():  # write where the link points; the link stays
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"Cannot save a checkpoint to {str(path)!r}: it is a file, not a folder.")
    temp = None
    if write:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{path.name}.saving-{os.getpid()}-{os.urandom(4).hex()}"
        temp.mkdir()
    try:
        stream = iter(tensors)
        for file, names in zip(files, shards):
            pairs = itertools.islice(stream, len(names))
            if temp is None:
                for _ in pairs:
                    pass
            else:
                write_safetensors(temp / file, pairs, {n: layout[n] for n in names})
        if temp is None:
            return
        if n > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {
                    name: file for file, names in zip(files, shards) for name in sorted(names)
                },
            }
            _write_text(temp / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
        _write_text(temp / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")
        _swap(temp, path)
        temp = None
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _write_text(file: Path, text: str) -> None:
    with open(file, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _is_checkpoint_file(name: str) -> bool:
    return name in (CONFIG, INDEX) or name.endswith(".safetensors")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _swap(new: Path, path: Path) -> None:
    """Put the finished folder `new` at `path`: carry over `path`'s other files, rename the
    old folder aside, rename `new` into place, remove the old."""
    if not path.exists():
        os.rename(new, path)
        return
    for entry in path.iterdir():
        if _is_checkpoint_file(entry.name) and not entry.is_dir():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, new / entry.name, symlinks=True, copy_function=_link_or_copy)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), new / entry.name)
        else:
            _link_or_copy(str(entry), str(new / entry.name))
    old = path.parent / f".{path.name}.old-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(path, old)
    try:
        os.rename(new, path)
    except OSError:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)

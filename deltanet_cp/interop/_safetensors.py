"""A reader of `.safetensors` files, bfloat16 included, with numpy and ml_dtypes only.

The format: an 8-byte little-endian header length, a JSON header mapping each tensor's name
to its `dtype`, `shape` and `data_offsets` (from the end of the header), then the bytes.
The `safetensors` package's numpy reader refuses bfloat16 (numpy has no such dtype), the
dtype most checkpoints are stored in; `ml_dtypes` (a dependency of jax) has it.
"""

import json
import os
from pathlib import Path

import ml_dtypes
import numpy as np


_DTYPES = {
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


class TensorInfo:
    """Where one tensor lies in a file: its dtype, shape and byte range."""

    def __init__(self, file: Path, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.file, self.dtype, self.shape, self.start, self.end = file, dtype, shape, start, end


def read_header(file: str | os.PathLike) -> dict[str, TensorInfo]:
    """The tensors of one `.safetensors` file, by name (nothing is read but the header)."""
    file = Path(file)
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    base = 8 + size
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in _DTYPES:
            raise ValueError(
                f"Tensor {name!r} in {str(file)!r} has unsupported dtype {entry['dtype']}."
            )
        begin, end = entry["data_offsets"]
        out[name] = TensorInfo(
            file, entry["dtype"], tuple(entry["shape"]), base + begin, base + end
        )
    _check_ranges(out, base)
    return out


def _check_ranges(tensors: dict[str, TensorInfo], base: int) -> None:
    """The tensors' byte ranges tile the data from its start, in some order, as the format
    requires (the `safetensors` package refuses the same files): no two share a byte,
    none is reversed, no bytes are left between them."""
    at, before = base, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end)):
        if info.end < info.start:
            raise ValueError(f"tensor {name!r} has a reversed byte range")
        if info.start < at:
            raise ValueError(
                f"tensors {before!r} and {name!r} share bytes: their data_offsets overlap"
            )
        if info.start > at:
            raise ValueError(f"the bytes before tensor {name!r} belong to no tensor (a hole)")
        at, before = info.end, name


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's values, as a numpy array (bfloat16 as `ml_dtypes.bfloat16`)."""
    dtype = np.dtype(_DTYPES[info.dtype])
    count = int(np.prod(info.shape, dtype=np.int64))
    if count * dtype.itemsize != info.end - info.start:
        raise ValueError(
            f"A tensor of {str(info.file)!r} has a byte range that does not fit its shape."
        )
    if count == 0:
        return np.zeros(info.shape, dtype)
    with open(info.file, "rb") as f:
        f.seek(info.start)
        data = f.read(info.end - info.start)
    return np.frombuffer(data, dtype).reshape(info.shape).copy()

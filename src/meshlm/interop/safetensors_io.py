"""The safetensors file format, read through a memory map and written tensor by tensor.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor
name to {dtype, shape, data_offsets} (plus an optional "__metadata__" of strings), then the raw
little-endian bytes. Nothing in it is executable, which is why meshlm reads weights from it only.

meshlm reads it itself rather than through the `safetensors` package because that package's
NumPy reader cannot return bfloat16 (NumPy has no such type; JAX's `ml_dtypes` does), and its
other readers need torch or load onto a default device. The reader checks the header against the
file (known dtypes, offsets inside the data section, byte counts equal to shape x itemsize) before
any tensor is used, and returns read-only views of the memory map, so a tensor costs no memory
until it is sliced and copied. The tests cross-check both directions against the `safetensors`
package and `transformers`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from meshlm import config
from meshlm.config import ConfigError

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),  # DeepSeek-V3's released weights
}
FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"  # an FP8 weight's per-block scales: `<name>_scale_inv`
CODES = {v: k for k, v in DTYPES.items()}
# The floating-point codes by the name torch, JAX and config files use (the dtypes weights are
# imported from and exported to).
FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
EXPORT_DTYPES = config.EXPORT_DTYPES


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a floating-point dtype name ("bfloat16" is ml_dtypes')."""
    codes = {v: k for k, v in FLOATS.items()}
    if name not in codes:
        raise ConfigError(f"unknown floating-point dtype {name!r}; choose from {', '.join(codes)}")
    return DTYPES[codes[name]]


MAX_HEADER = 100 * 2**20  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """({name: TensorInfo}, metadata) of one file, every entry checked against the file's size."""
    bad = lambda why: ConfigError(f"{path} is not a valid safetensors file: {why}")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise bad(f"header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    base, out = 8 + n, {}
    for name, entry in header.items():
        try:
            dtype, shape, (a, b) = entry["dtype"], tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {name!r} has a malformed entry {entry!r}") from None
        if dtype not in DTYPES:
            raise bad(f"tensor {name!r} has unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if any(d < 0 for d in shape) or not (isinstance(a, int) and isinstance(b, int) and 0 <= a <= b):
            raise bad(f"tensor {name!r} has a negative dimension or bad offsets")
        if b - a != want or base + b > size:
            raise bad(f"tensor {name!r}: {b - a} bytes at [{a}, {b}) for shape {list(shape)} {dtype} ({want} bytes)")
        out[name] = TensorInfo(path, dtype, shape, base + a, base + b)
    return out, meta


class Reader:
    """Tensors of one or more safetensors files by name, each a read-only memory-mapped view; an FP8
    weight comes dequantised to float32 by its block scales (`fp8_block`: rows x columns per scale)."""

    def __init__(self, files: Iterable[Path], fp8_block: tuple[int, int] = (128, 128)):
        self.fp8_block = fp8_block
        self.tensors: dict[str, TensorInfo] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        for path in files:
            infos, _ = read_header(path)
            for name, info in infos.items():
                if name in self.tensors:
                    raise ConfigError(f"tensor {name!r} is in both {self.tensors[name].file} and {path}")
                self.tensors[name] = info

    def get(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info.file not in self._maps:
            with info.file.open("rb") as f:
                self._maps[info.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._maps[info.file])[info.start : info.end]
        x = np.frombuffer(buf, dtype=DTYPES[info.dtype]).reshape(info.shape)
        if info.dtype != FP8:
            return x
        if name + SCALE_SUFFIX not in self.tensors:
            raise ConfigError(f"FP8 tensor {name} in {info.file} has no {name + SCALE_SUFFIX} to dequantise it by")
        return dequantize(x, self.get(name + SCALE_SUFFIX), self.fp8_block, name)

    def close(self) -> None:
        for m in self._maps.values():
            with contextlib.suppress(BufferError):  # a view is still alive: it closes when collected
                m.close()
        self._maps.clear()


def dequantize(x: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str = "") -> np.ndarray:
    """An FP8 weight [rows, cols] in float32: each element times the scale of its block (DeepSeek-V3's
    `weight_scale_inv`, [ceil(rows / block rows), ceil(cols / block cols)])."""
    (r, c), want = block, tuple(-(-n // b) for n, b in zip(x.shape, block, strict=False))
    if x.ndim != 2 or scale_inv.shape != want:
        raise ConfigError(
            f"{name}: FP8 scales of shape {list(scale_inv.shape)} do not tile a {list(x.shape)} weight "
            f"in blocks of {r} x {c} (expected {list(want)})"
        )
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), r, 0), c, 1)[: x.shape[0], : x.shape[1]]
    return x.astype(np.float32) * scales


def write(
    path: Path,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
    arrays: Iterator[np.ndarray],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write a file whose header lists `tensors` (name, shape, dtype), then the bytes of `arrays`
    in the same order, one at a time (each is cast to its declared dtype and checked)."""
    entries, offset = {}, 0
    specs = list(tensors)
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        entries[name] = {
            "dtype": CODES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header = {"__metadata__": metadata or {}} | entries
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, dtype), arr in zip(specs, arrays, strict=True):
            arr = np.ascontiguousarray(np.asarray(arr).astype(dtype, copy=False))
            if arr.shape != tuple(shape):
                raise ValueError(f"{name}: got shape {arr.shape}, declared {tuple(shape)}")
            f.write(arr.tobytes())

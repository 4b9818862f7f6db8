"""A GGUF file opened for inference: metadata parsed, tensor data mapped (never copied).

Why not gguf-py's ``GGUFReader``: it builds a numpy array per metadata element, so a file with a
49k-token vocabulary takes seconds and ~150 MB just to open. Here the header is walked once with
``struct``; arrays (the vocabulary, merges) are kept as (type, count, offset) and decoded only if
asked for. Tensor data are read-only views into one ``np.memmap`` of the file: the OS pages the
weights in on first use and shares them with the page cache.

Format (little-endian): magic ``GGUF``, version (2 or 3), tensor count, metadata count; metadata
as (key, type, value); tensor infos as (name, n_dims, dims with the fastest-varying first, type,
offset); tensor data from the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ratchetlm.layers.ggml_types import GGML_TYPES

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFFormatError(ValueError):
    """Not a GGUF file, or a truncated / corrupt one."""


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array, decoded on demand (``GGUFFile.array``)."""

    type: int
    count: int
    offset: int  # of the first element


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str  # GGMLQuantizationType name, e.g. "Q4_K"
    shape: tuple[int, ...]  # numpy order: rows first, the K (fastest-varying) dimension last
    data: np.ndarray  # [rows, row_bytes] uint8 view of the mapped file (1-D tensors: [1, bytes])

    @property
    def ggml_type(self) -> Any:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType[self.type_name]

    def dense(self) -> np.ndarray:
        """fp32 copy in ``shape`` (gguf-py's dequantization for quantized formats)."""
        if self.type_name == "F32":
            arr = self.data.view(np.float32)
        elif self.type_name == "F16":
            arr = self.data.view(np.float16).astype(np.float32)
        else:
            from gguf.quants import dequantize

            arr = dequantize(self.data, self.ggml_type)
        return np.array(arr, dtype=np.float32).reshape(self.shape)


class GGUFFile:
    """``meta``: key -> int / float / bool / str / :class:`ArrayValue`; ``tensors``: name -> tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.stat().st_size == 0:
            raise GGUFFormatError(f"{self.path} is empty (0 bytes), not a GGUF file")
        self._map = np.memmap(self.path, mode="r")
        buf = memoryview(self._map)  # type: ignore[arg-type]
        self._buf = buf
        if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
            raise GGUFFormatError(f"{self.path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        # Every count and length below comes from the file: each is checked against the bytes left, so
        # a truncated, zero-filled (an unfinished download) or corrupt header is named as such instead of
        # surfacing as an IndexError / OverflowError from the walk.
        if n_kv * 13 > len(buf) or n_tensors * 28 > len(buf):  # the smallest entry of each: 13 and 28 bytes
            self._corrupt(f"it declares {n_kv} metadata entries and {n_tensors} tensors, more than "
                          f"its {len(buf)} bytes can hold")
        pos = 24
        self.meta: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key, pos = self._string(pos)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                self.meta[key], pos = self._value(vtype, pos + 4)
            infos = []
            for _ in range(n_tensors):
                name, pos = self._string(pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
                    self._corrupt(f"tensor {name!r} has {n_dims} dimensions (1 to 4 are possible)")
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                ttype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                infos.append((name, dims, ttype, offset))
        except struct.error:
            raise GGUFFormatError(f"{self.path}: truncated GGUF header (the file ends at byte {len(buf)}, "
                                  "inside the header)") from None
        align = self.meta.get("general.alignment", 32)
        if not isinstance(align, int) or isinstance(align, bool) or not 1 <= align <= 1 << 20:
            self._corrupt(f"general.alignment is {align!r}")
        start = (pos + align - 1) // align * align
        self.tensors: dict[str, GGUFTensor] = {}
        for name, dims, ttype, offset in infos:
            if ttype not in GGML_TYPES:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} has unknown type id {ttype}")
            type_name, blck, nbytes = GGML_TYPES[ttype]
            k, rows = int(dims[0]), 1
            for d in dims[1:]:
                rows *= int(d)  # (Python ints: corrupt dims cannot overflow)
            row_bytes = k // blck * nbytes
            lo = start + offset
            if k % blck or lo + rows * row_bytes > len(self._map):
                raise GGUFFormatError(f"{self.path}: tensor {name!r} lies outside the file or has a bad shape "
                                      f"(the file has {len(self._map)} bytes: truncated?)")
            data = self._map[lo:lo + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors[name] = GGUFTensor(name, type_name, tuple(int(d) for d in reversed(dims)), data)

    def _corrupt(self, why: str) -> NoReturn:
        raise GGUFFormatError(f"{self.path}: corrupt GGUF header: {why} (a truncated or unfinished download?)")

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def array(self, key: str) -> list[Any]:
        """Decode a metadata array (e.g. ``tokenizer.ggml.tokens``)."""
        arr = self.meta[key]
        assert isinstance(arr, ArrayValue), key
        out, pos = [], arr.offset
        for _ in range(arr.count):
            v, pos = self._value(arr.type, pos)
            out.append(v)
        return out

    # ---------------------------------------------------------------- header walking

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        self._need(pos + 8, n, "a string")
        return bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def _need(self, pos: int, n: int, what: str) -> None:
        if pos + n > len(self._buf):
            raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF header: {what} at byte {pos} needs {n} "
                                  f"bytes, past the end of the file ({len(self._buf)} bytes)")

    def _value(self, vtype: int, pos: int) -> tuple[Any, int]:
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._string(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            arr = ArrayValue(etype, count, pos)
            if etype in _SCALARS:
                size = count * struct.calcsize(_SCALARS[etype])
                self._need(pos, size, f"an array of {count} values")
                return arr, pos + size
            if etype == _STRING:  # walk over the lengths only (a vocabulary is ~100k strings)
                self._need(pos, 8 * count, f"an array of {count} strings")
                length = _U64.unpack_from
                for _ in range(count):
                    pos += 8 + length(self._buf, pos)[0]
                    if pos > len(self._buf):
                        raise GGUFFormatError(f"{self.path}: truncated or corrupt GGUF header: the strings of an "
                                              f"array of {count} run past the end of the file ({len(self._buf)} "
                                              "bytes)")
                return arr, pos
            self._need(pos, 12 * count, f"an array of {count} arrays")
            for _ in range(count):  # nested arrays
                _, pos = self._value(etype, pos)
            return arr, pos
        raise GGUFFormatError(f"{self.path}: unknown metadata value type {vtype}")

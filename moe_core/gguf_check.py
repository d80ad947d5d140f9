"""A GGUF file's layout checked before any reader trusts it: the header's counts and lengths against the bytes that
are there, every key's value type, and every tensor's extent (its elements times its type's size, inside the data
section, on the alignment, overlapping no other tensor, and packed as GGUF writers place them: the gap to the next
tensor smaller than the alignment). A model file is untrusted input: what is wrong is refused in one line naming the
field or tensor, never an IndexError from deep inside a reader, and the work is bounded by the file's size.

The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (version 2 and 3; little-endian)."""
from __future__ import annotations

import mmap
import os
import pathlib
import struct
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from moe_core.config import ModelConfigError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40  # far past any tensor a machine here can hold; bounds the arithmetic below
MAX_NESTING = 4  # arrays of arrays
# value type -> struct code of its scalar (8: string, 9: array)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class GGUFError(ModelConfigError):
    pass


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """GGML type id -> (name, elements a block, bytes a block), from the gguf package (the types llama.cpp writes)."""
    return {int(q): (q.name, *GGML_QUANT_SIZES[q]) for q in GGMLQuantizationType if q in GGML_QUANT_SIZES}


class _Cursor:
    """Reads the header from the mapped file; every read checked against its end."""

    def __init__(self, buf, path: pathlib.Path):
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what} (a {_size(self.end)} file)")

    def skip(self, n: int, what: str) -> int:
        """-> where the n bytes start."""
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"{what}: {n} bytes at offset {self.pos}, past the end of the file")
        self.pos += n
        return self.pos - n

    def take(self, n: int, what: str) -> bytes:
        at = self.skip(n, what)
        return self.buf[at:at + n]  # a copy: no view of the map outlives the check

    def scalar(self, code: str, what: str):
        return struct.unpack("<" + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"{what}'s length")
        raw = self.take(n, f"{what} of {n} bytes")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - n} is not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """A value of a key (kept only where this check needs it: scalars and strings; arrays are skipped)."""
        if vtype in SCALARS:
            return self.scalar(SCALARS[vtype], what)
        if vtype == STRING:
            return self.string(what)
        if vtype != ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth >= MAX_NESTING:
            raise self.fail(f"{what}: arrays nested deeper than {MAX_NESTING}")
        itype = self.scalar("I", f"{what}'s item type")
        count = self.scalar("Q", f"{what}'s item count")
        if itype in SCALARS:  # skipped whole: count x size must be there
            self.skip(count * struct.calcsize(SCALARS[itype]), f"{what}: {count} items")
            return None
        if itype not in (STRING, ARRAY):
            raise self.fail(f"{what}: unknown item type {itype}")
        if count > (self.end - self.pos) // 8:  # every string or array item takes at least 8 bytes
            raise self.fail(f"{what}: {count} items cannot fit in the {self.end - self.pos} bytes left")
        for i in range(count):
            self.value(itype, f"{what}[{i}]", depth + 1)
        return None


def check(path: str | os.PathLike) -> None:
    """GGUFError naming what is wrong with the file's layout; None when every extent is sound."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    if size < 24:
        raise GGUFError(f"{path}: {size} bytes, too short for a GGUF header (24)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        _check(_Cursor(buf, path), path)


def _check(c: _Cursor, path: pathlib.Path) -> None:
    if c.take(4, "magic") != MAGIC:
        raise c.fail("not a GGUF file (its first bytes are not 'GGUF')")
    version = c.scalar("I", "version")
    if version not in (2, 3):
        raise c.fail(f"GGUF version {version} (versions 2 and 3 are read)")
    n_tensors = c.scalar("Q", "the tensor count")
    n_kv = c.scalar("Q", "the key count")
    if n_kv > (c.end - c.pos) // 13:  # a key: at least an 8-byte length, a 4-byte type and a 1-byte value
        raise c.fail(f"header: {n_kv} keys cannot fit in the file")
    if n_tensors > (c.end - c.pos) // 32:  # a tensor's info: at least 8 + 4 + 4 + 8 + 8 bytes
        raise c.fail(f"header: {n_tensors} tensors cannot fit in the file")
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        key = c.string(f"key {i}'s name")
        vtype = c.scalar("I", f"key {key!r}'s value type")
        value = c.value(vtype, f"key {key!r}")
        if key == "general.alignment":
            if vtype != 4 or not value or value & (value - 1):
                raise c.fail(f"general.alignment must be a power of two as uint32, got {value!r}")
            alignment = value
    sizes = _quant_sizes()
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i}'s name")
        n_dims = c.scalar("I", f"tensor {name}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(f"tensor {name}: {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [c.scalar("Q", f"tensor {name}'s dimension {d}") for d in range(n_dims)]
        ttype = c.scalar("I", f"tensor {name}'s type")
        offset = c.scalar("Q", f"tensor {name}'s offset")
        if ttype not in sizes:
            raise c.fail(f"tensor {name}: unknown type {ttype}")
        tname, block, nbytes = sizes[ttype]
        elements = 1
        for d in dims:
            if d == 0 or d > MAX_ELEMENTS:
                raise c.fail(f"tensor {name}: dimension of {d} elements")
            elements *= d
            if elements > MAX_ELEMENTS:
                raise c.fail(f"tensor {name}: {'x'.join(map(str, dims))} elements, more than 2^40")
        if dims[0] % block:
            raise c.fail(f"tensor {name}: rows of {dims[0]} elements are not whole {tname} blocks of {block}")
        infos.append((offset, elements // block * nbytes, name, tname))
    start = -(-c.pos // alignment) * alignment
    data = c.end - start
    if data < 0:
        raise c.fail(f"the data section would start at {start}, past the end of the file")
    for offset, nbytes, name, tname in infos:  # each on its own first: the fault named is the tensor's own
        where = f"tensor {name} ({tname}, {nbytes} bytes)"
        if offset % alignment:
            raise c.fail(f"{where}: offset {offset} is not a multiple of the alignment {alignment}")
        if offset > data or nbytes > data - offset:
            raise c.fail(f"{where}: data at offset {offset} of the data section runs past the end of the file "
                         f"(the data section holds {data} bytes)")
    infos.sort()
    for k, (offset, nbytes, name, tname) in enumerate(infos):
        where = f"tensor {name} ({tname}, {nbytes} bytes)"
        end = offset + nbytes
        nxt = infos[k + 1][0] if k + 1 < len(infos) else data
        if k + 1 < len(infos) and nxt < end:
            raise c.fail(f"{where}: its bytes [{offset}, {end}) overlap tensor {infos[k + 1][2]} at {nxt}: its type "
                         "or shape does not match its data")
        if nxt - end >= alignment:
            after = f"tensor {infos[k + 1][2]}" if k + 1 < len(infos) else "the end of the file"
            raise c.fail(f"{where}: {nxt - end} bytes lie unused before {after}, more than the alignment "
                         f"{alignment}: its type or shape does not match its data")

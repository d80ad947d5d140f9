"""A safetensors file's header checked before its tensors are mapped: a header length inside the file, a JSON object
of tensors, each with a known dtype, a shape, and data offsets whose extent is its elements times its dtype's size,
inside the data section and overlapping no other tensor. The safetensors library checks most of this too, but says
"invalid shape, data type, or offset for tensor" without naming the tensor; this names it (a model file is untrusted
input). Format: https://github.com/huggingface/safetensors#format."""
from __future__ import annotations

import json
import os
import pathlib
import struct

from moe_core.config import ModelConfigError

MAX_HEADER = 100 << 20  # the library's own bound
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6,
              "F6_E3M2": 6, "C64": 64}


def check(path: str | os.PathLike) -> None:
    """ModelConfigError naming what is wrong with the file's header; None when every tensor's extent is sound."""
    path = pathlib.Path(path)
    size = path.stat().st_size

    def fail(what: str) -> ModelConfigError:
        return ModelConfigError(f"{path}: {what} (a {size}-byte safetensors file)")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise fail("too short for a header length")
        n = struct.unpack("<Q", head)[0]
        if n > min(MAX_HEADER, size - 8):
            raise fail(f"a header of {n} bytes cannot fit")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError) as e:
            raise fail(f"the header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise fail("the header is not a JSON object")
    data = size - 8 - n
    spans = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise fail(f"tensor {name}: not an object")
        dtype, shape, offsets = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dtype not in DTYPE_BITS:
            raise fail(f"tensor {name}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape):
            raise fail(f"tensor {name}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise fail(f"tensor {name}: data_offsets {offsets!r} are not [begin, end]")
        elements = 1
        for d in shape:
            elements *= d
        want = (elements * DTYPE_BITS[dtype] + 7) // 8
        begin, end = offsets
        if end > data:
            raise fail(f"tensor {name}: data at [{begin}, {end}) runs past the {data}-byte data section")
        if end - begin != want:
            raise fail(f"tensor {name}: {'x'.join(map(str, shape)) or 'scalar'} {dtype} is {want} bytes, but its "
                       f"data_offsets hold {end - begin}")
        spans.append((begin, end, name))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise fail(f"tensor {n1}: data at {b1} overlaps tensor {n0} [{b0}, {e0})")
        if b1 > e0:  # the format packs tensors back to back, as the library requires
            raise fail(f"tensor {n1}: data at {b1} leaves {b1 - e0} bytes unused after tensor {n0}")
    if spans and spans[0][0] != 0:
        raise fail(f"tensor {spans[0][2]}: the first data starts at {spans[0][0]}, not 0")
    if (spans[-1][1] if spans else 0) != data:
        raise fail(f"the tensors' data ends at {spans[-1][1] if spans else 0} of a {data}-byte data section")

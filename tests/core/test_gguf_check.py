"""moe_core/gguf_check.py: a GGUF file's header and every tensor's extent checked against its bytes before a reader
trusts them. Each fault a hostile or damaged file can carry (a retyped tensor, counts and lengths past the file, too
many dimensions or elements, data past the end) is refused in one line naming the field or tensor; a fuzz of bit
flips, truncations and overwritten header fields of a valid file never gets past the check into an error of the
reader's own."""
from __future__ import annotations

import pathlib
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_core import gguf_check
from moe_core.gguf_model import _reader
from moe_core.config import ModelConfigError

TENSORS = {"blk.0.attn_q.weight": (Q.Q8_0, (4, 256)), "blk.1.ffn_down_exps.weight": (Q.Q8_0, (2, 4, 256)),
           "output_norm.weight": (Q.F32, (256,))}


def tiny(path: pathlib.Path) -> pathlib.Path:
    """A valid little GGUF: a string, an array of strings, a uint32, two Q8_0 tensors and an F32 one."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_string("general.name", "tiny")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_uint32("qwen3moe.block_count", 2)
    rng = np.random.default_rng(0)
    for name, (qtype, shape) in TENSORS.items():
        a = rng.standard_normal(shape).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    return tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def offsets(data: bytes, tmp: pathlib.Path) -> dict[str, list[int]]:
    """Field or tensor name -> the byte offset of each of its parts (the gguf package's reader, on the valid file)."""
    p = tmp / "layout.gguf"
    p.write_bytes(data)
    r = gguf.GGUFReader(str(p))
    out = {}
    for f in [*r.fields.values(), *(t.field for t in r.tensors)]:
        at, parts = f.offset, []
        for part in f.parts:
            parts.append(at)
            at += part.nbytes
        out[f.name] = parts
    return out


def refusal(data: bytes, tmp: pathlib.Path) -> str:
    p = tmp / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(gguf_check.GGUFError) as e:
        gguf_check.check(p)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg, msg
    with pytest.raises(ModelConfigError):  # and the services' reader refuses it the same way
        _reader(p)
    return msg


def put(data: bytes, at: int, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, at, value)
    return bytes(b)


def test_the_valid_file_passes(valid, tmp_path):
    p = tmp_path / "ok.gguf"
    p.write_bytes(valid)
    gguf_check.check(p)
    assert {t.name for t in _reader(p).tensors} == set(TENSORS)


@pytest.mark.parametrize("name, to, says", [
    ("blk.0.attn_q.weight", Q.F32, "overlap tensor blk.1.ffn_down_exps.weight"),  # 16 KiB where 1088 bytes belong
    ("blk.1.ffn_down_exps.weight", Q.Q6_K, "bytes lie unused before tensor output_norm.weight"),  # smaller
    ("output_norm.weight", Q.Q8_0, "bytes lie unused before the end of the file"),
    ("output_norm.weight", Q.F64, "runs past the end of the file"),
    ("blk.0.attn_q.weight", Q.Q4_K, "bytes lie unused"),
])
def test_a_retyped_tensor_is_refused_naming_it(valid, tmp_path, name, to, says):
    at = offsets(valid, tmp_path)[name]
    msg = refusal(put(valid, at[4], "I", int(to)), tmp_path)
    assert f"tensor {name} ({to.name}" in msg and says in msg, msg


def test_header_fields_past_the_file_are_refused(valid, tmp_path):
    at = offsets(valid, tmp_path)
    cases = [
        (put(valid, at["general.name"][3], "Q", 1 << 63), "key 'general.name' of 9223372036854775808 bytes"),
        (put(valid, at["tokenizer.ggml.tokens"][4], "Q", 1 << 62), "cannot fit"),
        (put(valid, 8, "Q", 1 << 60), "tensors cannot fit"),
        (put(valid, 16, "Q", 1 << 60), "keys cannot fit"),
        (valid[:100], "3 tensors cannot fit"),
        (valid[:300], "past the end of the file"),
        (valid[:20], "too short for a GGUF header"),
        (put(valid, at["blk.0.attn_q.weight"][5], "Q", 1 << 63), "tensor blk.0.attn_q.weight (Q8_0, 1088 bytes): data at offset 9223372036854775808"),
        (put(valid, at["blk.0.attn_q.weight"][3], "Q", 1 << 40), "more than 2^40"),
        (put(valid, at["blk.0.attn_q.weight"][2], "I", 200), "tensor blk.0.attn_q.weight: 200 dimensions"),
        (put(valid, at["blk.0.attn_q.weight"][4], "I", 999), "unknown type 999"),
        (put(valid, at["blk.0.attn_q.weight"][3], "Q", 100), "not whole Q8_0 blocks of 32"),
        (put(valid, at["qwen3moe.block_count"][2], "I", 77), "unknown value type 77"),
        (put(valid, 4, "I", 1), "GGUF version 1"),
        (b"GGML" + valid[4:], "not a GGUF file"),
    ]
    for data, says in cases:
        msg = refusal(data, tmp_path)
        assert says in msg, (says, msg)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_damaged_files_are_refused_by_the_check_or_read_whole(valid, tmp_path, data):
    """Bit flips, truncations and overwritten 8-byte fields anywhere in the header: the check refuses the file with
    a GGUFError or passes it, and a file it passes the gguf package reads and maps whole."""
    header_end = offsets(valid, tmp_path)["output_norm.weight"][5] + 8
    b = bytearray(valid)
    kind = data.draw(st.sampled_from(["flip", "truncate", "field"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, header_end - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    else:
        i = data.draw(st.integers(0, header_end - 8))
        b[i:i + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**40, 2**62, 2**63, 2**64 - 1])))
    p = tmp_path / "fuzz.gguf"
    p.write_bytes(bytes(b))
    try:
        gguf_check.check(p)
    except gguf_check.GGUFError as e:
        assert "\n" not in str(e)
        return
    r = gguf.GGUFReader(str(p))
    for t in r.tensors:
        assert t.data.nbytes == t.n_bytes

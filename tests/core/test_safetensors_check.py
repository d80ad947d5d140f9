"""moe_core/safetensors_check.py under a fuzz of a valid tiny file: bit flips, truncations and overwritten bytes of
its header either get a one-line refusal naming the file, or pass and then read whole with the safetensors library
(never a crash, a hang or an error of the library's own)."""
from __future__ import annotations

import pathlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from moe_core import safetensors_check
from moe_core.config import ModelConfigError


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> bytes:
    p = tmp_path_factory.mktemp("st") / "tiny.safetensors"
    save_file({"a.weight": torch.randn(4, 6), "b.bias": torch.zeros(5, dtype=torch.bfloat16),
               "c.idx": torch.arange(3, dtype=torch.int64)}, str(p))
    return p.read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_damaged_headers_are_refused_by_the_check_or_read_whole(valid, tmp_path, data):
    n = int.from_bytes(valid[:8], "little") + 8
    b = bytearray(valid)
    kind = data.draw(st.sampled_from(["flip", "truncate", "byte", "length"]))
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 6))):
            i = data.draw(st.integers(0, n - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        b = b[:data.draw(st.integers(0, len(b) - 1))]
    elif kind == "byte":  # a digit of an offset or a shape, a quote, a bracket
        i = data.draw(st.integers(8, n - 1))
        b[i] = ord(data.draw(st.sampled_from(list('0123456789",[]{}:-'))))
    else:
        b[:8] = data.draw(st.sampled_from([0, 1, 2**31, 2**62, 2**64 - 1, n + 1000])).to_bytes(8, "little")
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(b))
    try:
        safetensors_check.check(p)
    except ModelConfigError as e:
        assert "\n" not in str(e) and str(p) in str(e)
        return
    with safe_open(p, framework="pt") as f:
        for k in f.keys():
            f.get_tensor(k)


def test_the_valid_file_passes(valid, tmp_path: pathlib.Path):
    p = tmp_path / "ok.safetensors"
    p.write_bytes(valid)
    safetensors_check.check(p)

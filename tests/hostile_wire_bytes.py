"""Random and damaged exchange messages through the native wire reader, run as its own process by
tests/e2e/test_isolation.py under AddressSanitizer: wire_head, wire_result, wire_result_output and
exchange_part on bytes cut, flipped and stretched from good ones. Prints the count of messages read;
an out-of-bounds access aborts the process (ASan)."""
from __future__ import annotations

import argparse
import random
import sys

from hostile_ring_peer import load_native


def damaged(good: bytes, rnd: random.Random) -> bytes:
    b = bytearray(good)
    for _ in range(rnd.choice((0, 1, 2, 4))):  # a quarter left whole: they reach the kernels
        i = rnd.randrange(len(b)) if b else 0
        op = rnd.randrange(4)
        if op == 0 and b:
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 12)))
        else:  # a length or varint made huge
            b[i:i + 1] = b"\xff" * rnd.randint(1, 11)
    return bytes(b)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--native", default=None)
    ap.add_argument("--n", type=int, default=3000)
    a = ap.parse_args()
    native = load_native(a.native)
    import torch

    from moe_experts.kernels.native_moe import NativeMoELayer
    from moe_exchange import codec, wire
    from protos import expert_pb2

    E, I, H = 4, 32, 64
    op = NativeMoELayer(torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1, "bf16", 1)
    rnd = random.Random(0)
    taken = 0
    for i in range(a.n):
        T, k = rnd.randint(0, 3), rnd.randint(1, 4)
        x, ids, w = torch.randn(T, H).bfloat16(), torch.randint(-1, E, (T, k), dtype=torch.int32), torch.rand(T, k)
        req = damaged(wire.request(i, 0, x, ids, w, rnd.randint(0, k - 1)), rnd)
        if native.wire_head(req) is not None:
            taken += 1
            try:
                op.exchange_part(req, 0, 0)
            except ValueError:
                pass  # refused: wrong hidden size, bad ids, non-finite values
        res = expert_pb2.LayerResult(layer=1, output=codec.encode(x), timing=expert_pb2.ExpertTiming(compute_us=i))
        bad = damaged(res.SerializeToString(), rnd)
        h = native.wire_result(bad)
        if h is not None and h.nbytes < 1 << 20:
            out = bytearray(h.nbytes)
            try:
                native.wire_result_output(bad, (ctypes_addr(out)), h.nbytes)
            except ValueError:
                pass
    print(taken)
    return 0


def ctypes_addr(buf: bytearray) -> int:
    import ctypes
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


if __name__ == "__main__":
    sys.exit(main())

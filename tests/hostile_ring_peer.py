"""A hostile GPU side for one shared-memory session, run as its own process by tests/e2e/test_isolation.py
(under AddressSanitizer there): it posts well-formed layer requests while a second thread keeps
rewriting what the expert side reads (request descriptors, ids, weights, hidden states, span offsets
and sizes, dtypes, token counts) behind the server's back. The expert side is the real one
(moe_exchange.ring.RingServer over an ExpertServicer with native layers).

Prints one JSON line: requests posted, responses by status. Exits 0 when the server answered every
request and never crashed; an out-of-bounds access aborts the process (ASan) or crashes it."""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import mmap
import os
import random
import struct
import sys
import threading
import time
import types


def load_native(path: str | None):
    """Use the extension at `path` (the ASan build) instead of the installed one."""
    if path:
        spec = importlib.util.spec_from_file_location("moe_kernels._native", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules["moe_kernels._native"] = mod  # moe_kernels imports this one instead of the installed one
    from moe_kernels import native
    return native


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--native", default=None, help="path of the native library build to load")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--fmt", default="bf16")
    a = ap.parse_args()
    native = load_native(a.native)

    import torch

    from moe_experts.kernels.native_moe import NativeMoELayer
    from moe_exchange.ring import RingServer
    from expert_service.server import ExpertServicer
    from moe_exchange import codec, shm

    E, I, H, MAX_T = 16, 64, 128, 8
    torch.manual_seed(0)
    op = NativeMoELayer(torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1, a.fmt, 2)
    cfg = types.SimpleNamespace(hidden_size=H, moe_layers=[0], n_routed_experts=E, top_k=4)
    sv = ExpertServicer(cfg, a.fmt, op.path, 2, MAX_T)
    sv.attach({0: op}, "fp")

    size = shm.MIN_SIZE
    mm = mmap.mmap(-1, size)  # anonymous and shared: with the hammer process forked below too
    layout = shm.Layout(size)
    al = lambda n: (n + 63) // 64 * 64  # noqa: E731
    ids_at = [layout.block(b) + al(MAX_T * H * 4) for b in range(shm.REQ_SLOTS)]  # where T = MAX_T puts them
    hammer = os.fork()
    if hammer == 0:  # flip the ids and weights of every slot between valid and invalid as fast as it can
        import numpy as np
        words = np.frombuffer(mm, dtype=np.int32)
        n = MAX_T * 4
        good, evil = np.arange(n, dtype=np.int32) % E, np.full(n, E + 100_000, dtype=np.int32)
        nan = np.full(n, np.nan, dtype=np.float32).view(np.int32)
        end = time.monotonic() + a.seconds + 1
        while time.monotonic() < end:
            for _ in range(1000):
                for at in ids_at:
                    i, wi = at // 4, (at + al(n * 4)) // 4
                    words[i: i + n] = evil
                    words[wi: wi + n] = nan
                    words[i: i + n] = good
            if os.getppid() == 1:
                break
        os._exit(0)
    server = RingServer(mm, sv, "moe-shm-hostile")
    server.start()

    req_desc = shm.Layout.req_desc
    stop = threading.Event()
    rng = random.Random(1)
    u32, i32, f32, u64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<f"), struct.Struct("<Q")
    desc_fields = [8, 16, 20, 24, 28, 32, *range(40, 120, 8)]  # step, layer, T, k, defer, dtype, spans

    def scribble() -> None:
        evil64 = [0, 1, 63, 64, layout.data_start, size - 64, size, size + 64, 2**63, 2**64 - 1, 2**64 - 64]
        while not stop.is_set():
            for _ in range(200):
                what = rng.random()
                if what < 0.4:  # a descriptor field
                    off = req_desc(rng.randrange(shm.REQ_SLOTS)) + rng.choice(desc_fields)
                    if rng.random() < 0.5:
                        u64.pack_into(mm, off, rng.choice(evil64) + rng.choice((0, 0, 4, -4 % 2**64)) & (2**64 - 1))
                    else:
                        u32.pack_into(mm, off, rng.choice((0, 1, 2, 3, 7, 64, 65, 2**31, 2**32 - 1)))
                elif what < 0.8:  # ids / weights / hidden bytes somewhere in the data area
                    off = rng.randrange(layout.data_start, size - 4) // 4 * 4
                    if rng.random() < 0.5:
                        i32.pack_into(mm, off, rng.choice((-1, E, E + 1, 2**31 - 1, -2**31, rng.randrange(E))))
                    else:
                        f32.pack_into(mm, off, rng.choice((float("nan"), float("inf"), 1e38, -0.0, 0.5)))
                else:  # a whole run of garbage
                    off = rng.randrange(layout.data_start, size - 256)
                    mm[off: off + 256] = rng.randbytes(256)
            time.sleep(0)

    t = threading.Thread(target=scribble, daemon=True)
    t.start()

    statuses: collections.Counter = collections.Counter()
    posted = read = 0
    deadline = time.monotonic() + a.seconds
    f32_code = codec.TO_WIRE[torch.float32]
    ok = True
    while time.monotonic() < deadline:
        T, k = rng.choice((rng.randint(1, MAX_T), MAX_T)), 4  # T = MAX_T: the hammered spans
        defer = rng.randint(0, 3)
        base = layout.block(posted)
        xn, kn = T * H * 4, T * k * 4
        spans = [(base, xn), (base + al(xn), kn), (base + al(xn) + al(kn), kn), (base + al(xn) + 2 * al(kn), xn),
                 (base + 2 * al(xn) + 2 * al(kn), xn) if defer else (0, 0)]
        x = torch.randn(T, H)
        ids = torch.randint(0, E, (T, k), dtype=torch.int32)
        w = torch.rand(T, k)
        mm[spans[0][0]: spans[0][0] + xn] = x.numpy().tobytes()
        mm[spans[1][0]: spans[1][0] + kn] = ids.numpy().tobytes()
        mm[spans[2][0]: spans[2][0] + kn] = w.numpy().tobytes()
        shm.REQ_DESC.pack_into(mm, req_desc(posted), posted, 0, 0, T, k, defer, f32_code,
                               *[v for s in spans for v in s])
        posted += 1
        native.doorbell_ring(mm, shm.REQ_SEQ, posted & 0xFFFFFFFF)
        # wait for at least one more response (an answer or a refusal) to this request
        until = time.monotonic() + 30
        while u32.unpack_from(mm, shm.RESP_SEQ)[0] <= read and time.monotonic() < until:
            time.sleep(0.0005)
        got = u32.unpack_from(mm, shm.RESP_SEQ)[0]
        if got <= read:
            print(f"no response to request {posted - 1} within 30 s", file=sys.stderr)
            ok = False
            break
        time.sleep(0.002)  # the deferred part, if any, lands in the same window mostly
        got = u32.unpack_from(mm, shm.RESP_SEQ)[0]
        for j in range(read, got):
            status = u32.unpack_from(mm, shm.Layout.resp_desc(j) + 12)[0]
            statuses[status] += 1
        read = got
        u32.pack_into(mm, shm.RESP_READ, read)
        native.doorbell_wake(mm, shm.RESP_READ)
        if server.done.done():
            print("the ring server stopped", file=sys.stderr)
            ok = False
            break
    stop.set()
    t.join()
    u32.pack_into(mm, shm.CLOSED, 1)
    native.doorbell_wake(mm, shm.REQ_SEQ)
    server.done.result(timeout=30)
    os.waitpid(hammer, 0)
    print(json.dumps({"posted": posted, "responses": sum(statuses.values()),
                      "statuses": {str(k): v for k, v in statuses.items()}}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

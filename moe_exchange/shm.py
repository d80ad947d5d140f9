"""The shared-memory exchange ring: one place for its layout, its creation and its checks.

When both services run on one host the GPU service creates a region in /dev/shm (owner-only,
O_EXCL, a random name), registers it with the expert service over gRPC (OpenShm: name, size,
nonce) and both sides map it. The expert service unlinks the file as soon as it has it open, so
the name is gone within milliseconds and a crash of either side leaves nothing behind (the
mapping dies with the last process holding it). Per layer no gRPC is used: the GPU side writes
the tensors and a request descriptor and rings the request doorbell; the expert side answers
with response descriptors (one per part, IMMEDIATE then DEFERRED) and rings the response
doorbell. The OpenShm stream stays open for the session's life: either side closing it ends the
session.

Layout (little-endian, offsets in bytes from the region start):
  0     header: magic, version, slot counts, nonce
  64    req_seq   u32  requests posted (client rings)            | each doorbell on its own
  128   resp_seq  u32  responses posted (server rings)           | cache line
  192   resp_read u32  responses consumed (client; back-pressure)|
  256   closed    u32  1 once either side has left
  4096  request descriptors, REQ_SLOTS x REQ_DESC_SIZE
        response descriptors, RESP_SLOTS x RESP_DESC_SIZE
        data area (page-aligned), REQ_SLOTS equal blocks; request i uses block i % REQ_SLOTS for
        its hidden, ids, weights and both outputs.
The hot loops of both sides are C++ (native/exchange/ring.h mirrors this layout; a test checks they agree).
Every offset a descriptor carries is checked against the region before it is touched
(check_span): beyond the region, past its end, overlapping the header, misaligned or overflowing
64 bits is refused with INVALID_ARGUMENT, never read.
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
import stat
import struct
from dataclasses import dataclass

MAGIC = 0x31304853_4D454F4D  # "MOEMSH01"
VERSION = 1
HEADER = struct.Struct("<QIII16s")  # magic, version, req_slots, resp_slots, nonce
REQ_SEQ, RESP_SEQ, RESP_READ, CLOSED = 64, 128, 192, 256
DESC_START = 4096
SPAN_ALIGN = 64  # every tensor span starts on a cache line (the kernels read int32/fp32 vectors from them)
REQ_SLOTS, RESP_SLOTS = 4, 8  # a request has at most 2 responses: RESP_SLOTS = 2 * REQ_SLOTS never overflows
# request: seq, step, layer, T, k, defer, hidden dtype (wire enum), then (offset, nbytes) for
# hidden, ids, weights, immediate output, deferred output
REQ_DESC = struct.Struct("<QQIIIII4x" + "QQ" * 5)
REQ_DESC_SIZE = 256
# response: request seq, part, status (gRPC code), output (offset, nbytes), queued_us, compute_us,
# start_ns, end_ns, message length, message
RESP_DESC = struct.Struct("<QII QQ QQ qq I4x")
OK, INVALID_ARGUMENT, INTERNAL = 0, 3, 13  # the statuses a response carries: gRPC's codes (native/exchange/ring.h: Status)
MSG_MAX = 256
RESP_DESC_SIZE = 384
MIN_SIZE = 1 << 20
NAME_RE = re.compile(r"^moe-shm-[0-9]{1,10}-[0-9a-f]{16}$")
SHM_DIR = "/dev/shm"
assert REQ_DESC.size <= REQ_DESC_SIZE and RESP_DESC.size + MSG_MAX <= RESP_DESC_SIZE


class RegionError(ValueError):
    """A region that cannot be used; `code_name` is the gRPC status to answer with."""

    def __init__(self, code_name: str, msg: str):
        super().__init__(msg)
        self.code_name = code_name


@dataclass(frozen=True)
class Layout:
    size: int

    @property
    def data_start(self) -> int:
        end = DESC_START + REQ_SLOTS * REQ_DESC_SIZE + RESP_SLOTS * RESP_DESC_SIZE
        return (end + 4095) // 4096 * 4096

    @property
    def block_size(self) -> int:
        return (self.size - self.data_start) // REQ_SLOTS // 64 * 64

    def block(self, i: int) -> int:
        return self.data_start + (i % REQ_SLOTS) * self.block_size

    @staticmethod
    def req_desc(i: int) -> int:
        return DESC_START + (i % REQ_SLOTS) * REQ_DESC_SIZE

    @staticmethod
    def resp_desc(j: int) -> int:
        return DESC_START + REQ_SLOTS * REQ_DESC_SIZE + (j % RESP_SLOTS) * RESP_DESC_SIZE


def check_span(layout: Layout, off: int, nbytes: int, what: str) -> None:
    """Offsets come from the other process: validate before any access. Python ints do not
    overflow, but the values are u64 on the wire, so a huge offset is caught like any other."""
    if off < layout.data_start or nbytes < 0 or off > layout.size or nbytes > layout.size - off:
        raise RegionError("INVALID_ARGUMENT", f"{what}: span [{off}, {off}+{nbytes}) is outside the data area "
                          f"[{layout.data_start}, {layout.size}) of the shared region")
    if off % SPAN_ALIGN:
        raise RegionError("INVALID_ARGUMENT", f"{what}: span offset {off} is not a multiple of {SPAN_ALIGN}")


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def sweep_stale() -> int:
    """Remove regions of ours whose creator is dead (it crashed between creating a region and the
    expert service taking it). Returns how many went."""
    gone = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if not NAME_RE.match(name):
            continue
        pid = int(name.split("-")[2])
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            gone += 1
        except OSError:
            pass
    return gone


def create(size: int) -> tuple[str, bytes, mmap.mmap]:
    """Create an owner-only region with a fresh name and header. The caller unlinks the name once
    the peer has it (or on failure): see unlink()."""
    if size < MIN_SIZE:
        raise ValueError(f"shared region of {size} bytes is below the minimum of {MIN_SIZE}")
    sweep_stale()
    name = f"moe-shm-{os.getpid()}-{secrets.token_hex(8)}"
    nonce = secrets.token_bytes(16)
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        unlink(name)
        raise
    os.close(fd)
    HEADER.pack_into(mm, 0, MAGIC, VERSION, REQ_SLOTS, RESP_SLOTS, nonce)
    return name, nonce, mm


def attach(name: str, size: int, nonce: bytes, max_size: int) -> mmap.mmap:
    """The expert side: open a region the GPU side created, check it is what it claims, unlink it.
    Raises RegionError naming the problem."""
    if not NAME_RE.match(name):
        raise RegionError("INVALID_ARGUMENT", f"name: {name!r} is not a region name this service accepts")
    if not MIN_SIZE <= size <= max_size:
        raise RegionError("INVALID_ARGUMENT", f"size: {size} bytes outside [{MIN_SIZE}, {max_size}]")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise RegionError("NOT_FOUND", f"name: no region {name} in {SHM_DIR} (not on this host?)") from None
    except OSError as e:
        raise RegionError("PERMISSION_DENIED", f"name: cannot open {name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RegionError("INVALID_ARGUMENT", f"name: {name} is not a regular file")
        if st.st_uid != os.getuid():
            raise RegionError("PERMISSION_DENIED", f"name: {name} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
        if st.st_mode & 0o077:
            raise RegionError("PERMISSION_DENIED", f"name: {name} is accessible to others (mode {st.st_mode & 0o777:o}); "
                              "regions must be owner-only")
        if st.st_size != size:
            raise RegionError("INVALID_ARGUMENT", f"size: region is {st.st_size} bytes, not {size}")
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    magic, version, rq, rs, their_nonce = HEADER.unpack_from(mm, 0)
    if (magic, version, rq, rs) != (MAGIC, VERSION, REQ_SLOTS, RESP_SLOTS) or not secrets.compare_digest(their_nonce, nonce):
        mm.close()
        raise RegionError("INVALID_ARGUMENT", "region header or nonce does not match the registration")
    unlink(name)
    return mm


def unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass

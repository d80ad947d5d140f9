"""The packed-weight cache: a layer's experts as the native kernels hold them (packed rows, scales),
written once and read back on later starts instead of re-reading and re-quantizing the checkpoint.

One safetensors file per MoE layer in `<cache dir>/<fingerprint>-<format>-v<LAYOUT>/`, written to a
temporary name and renamed into place (a crash leaves no half-written layer under its real name).
Each file carries in its metadata what it was made from and an XXH3-64 hash of every 64 MiB chunk of
every tensor; a layer is used only if all of it matches (same model fingerprint, same source files by size
and mtime, same format, same packing layout, same shapes, every byte as written). Anything else is
logged and rebuilt, never trusted. A layer file is mapped read-only and the kernels read the
weights in place (the page cache's copy is the only one); on a machine with several NUMA nodes it is
read instead into huge-page buffers bound to each expert's node. The hashes are checked in parallel
chunks either way (XXH3, ~20 GB/s: a CRC-32 at ~4 GB/s was a third of a warm start).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import hashlib
import json
import logging
import math
import mmap
import os
import pathlib
import resource
import struct
import warnings

import torch
import xxhash

from moe_core.checkpoint import Checkpoint
from moe_kernels import native

from moe_experts.kernels import native_moe

log = logging.getLogger("expert_service.cache")

# Bump whenever the packed layout changes (row padding, int4 nibble order, scales): old caches are
# then stale by key, never misread.
LAYOUT = 2  # 2: the per-32 formats in 16-row blocks
PARTS = ("data", "scale", "rowsum", "rowcorr")
CHUNK = 64 << 20  # bytes per checksum, and per read task
PIECE = 4 << 20   # bytes per pread, hashed while in the CPU's cache
READERS = 2       # parallel pread + hash tasks (both release the GIL)
ALIGN = 4096      # the data section's start in a layer file; the weight tensors come first
CHECKSUM = "xxh3-64"  # in the metadata: a file checked another way is stale, rebuilt in place


def default_dir() -> pathlib.Path:
    env = os.environ.get("MOE_CACHE_DIR")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "moe-split"


def source_stamp(ckpt: Checkpoint) -> str:
    """The checkpoint files as they are now (name, size, mtime): the model fingerprint hashes only
    headers, so two checkpoints of one architecture would otherwise share a cache."""
    h = hashlib.sha256()
    for f in sorted(set(ckpt.weight_map.values())):
        st = (ckpt.dir / f).stat()
        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


ST_DTYPES = {torch.bfloat16: "BF16", torch.int8: "I8", torch.uint8: "U8", torch.float32: "F32", torch.int32: "I32"}


def write_safetensors(path: pathlib.Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file written straight from the tensors' memory (safetensors.torch.save_file first
    copies every tensor into bytes: a second copy of a whole packed layer)."""
    header, off = {"__metadata__": metadata}, 0
    for name, t in tensors.items():
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the data starts page-aligned (it is mapped and read in place)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _bytes(t: torch.Tensor):
    return t.view(torch.uint8).reshape(-1).numpy()


def chunk_hashes(t: torch.Tensor) -> list[int]:
    b = _bytes(t)
    return [xxhash.xxh3_64_intdigest(b[i:i + CHUNK]) for i in range(0, len(b), CHUNK)]


def _tensors(op) -> dict[str, torch.Tensor]:
    return {f"{m}.{p}": t for m, parts in (("gu", op.gu), ("dn", op.dn)) for p, t in zip(PARTS, parts)
            if t is not None}


def _layout(E: int, I: int, H: int, fmts: tuple[str, str]) -> dict[str, tuple]:
    """name -> (shape, dtype) of every tensor a layer file holds."""
    return {f"{m}.{p}": spec for m, parts in native_moe.NativeMoELayer.packed_layout(E, I, H, *fmts).items()
            for p, spec in zip(PARTS, parts) if spec is not None}


def _reader():
    return _pread if native.numa_binds() or not _can_lock else _map


_libc = ctypes.CDLL(None, use_errno=True)
_can_lock = True  # until an mlock fails: then every later layer is read into memory instead


def _lock(m: mmap.mmap) -> bool:
    """Pin a mapping's pages (mlock): mapped weights are file pages, which memory pressure could evict
    and the kernels would then read back from disk in the middle of a token. False where
    RLIMIT_MEMLOCK forbids it (Docker's default; compose raises it for the expert service)."""
    global _can_lock
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        ptr = torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr()
    if _libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(len(m))) == 0:
        return True
    _can_lock = False
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    log.warning("cannot lock the mapped packed-weight cache in memory (%s; RLIMIT_MEMLOCK %s): reading it into "
                "memory instead, which makes warm starts slower. Raise the limit (ulimit -l unlimited; compose: "
                "ulimits: memlock: -1) to use the mapped cache", os.strerror(ctypes.get_errno()),
                "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB")
    return False


def _check_all(check, tasks) -> bool:
    with concurrent.futures.ThreadPoolExecutor(READERS) as ex:
        return all(ex.map(check, tasks))


def _map(fd: int, size: int, want: dict, spans: dict, hashes: dict, empty) -> dict[str, torch.Tensor] | None:
    """The tensors as views of the file mapped read-only and locked in memory, as llama.cpp maps GGUF
    with --mlock: a warm start only maps pages the page cache holds already (no copy, no fresh memory
    to fault in: that, not the read, was most of a warm start), and the machine holds one copy of the
    weights, not two. Where the pages cannot be locked, _pread."""
    m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
    if not _lock(m):
        m.close()
        return _pread(fd, size, want, spans, hashes, empty)
    view = memoryview(m)

    def check(task) -> bool:
        off, nbytes, digest = task
        return xxhash.xxh3_64_intdigest(view[off:off + nbytes]) == digest

    tasks = [(off + i * CHUNK, min(CHUNK, nbytes - i * CHUNK), d)
             for name, (off, nbytes) in spans.items() for i, d in enumerate(hashes[name])]
    if not _check_all(check, tasks):
        view.release()
        m.close()
        return None
    with warnings.catch_warnings():  # read-only memory: the kernels never write weights
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        return {name: torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off).view(dtype).view(shape)
                for name, (off, nbytes) in spans.items() for shape, dtype in [want[name]]}


def _pread(fd: int, size: int, want: dict, spans: dict, hashes: dict, empty) -> dict[str, torch.Tensor] | None:
    """The tensors read into empty() (a layer's fresh buffers: weights on huge pages, each expert's
    slice bound to its NUMA node, on a machine with several nodes where a mapped file's pages would
    lie wherever they were read)."""
    out = empty()

    def read(task) -> bool:
        view, off, digest = task
        x = xxhash.xxh3_64()
        for i in range(0, len(view), PIECE):  # hashed while the piece is in the CPU's cache
            piece = view[i:i + PIECE]
            if os.preadv(fd, [piece], off + i) != len(piece):
                return False
            x.update(piece)
        return x.intdigest() == digest

    tasks = [(_bytes(out[name])[i * CHUNK:(i + 1) * CHUNK], off + i * CHUNK, d)
             for name, (off, nbytes) in spans.items() for i, d in enumerate(hashes[name])]
    return out if _check_all(read, tasks) else None


@dataclasses.dataclass
class PackedCache:
    root: pathlib.Path
    fingerprint: str
    stamp: str
    fmt: str
    shard: str = ""  # "I-of-N" for one shard's experts (moe_core.shards), "" for all

    @property
    def dir(self) -> pathlib.Path:
        return self.root / f"{self.fingerprint}-{self.fmt}{'-shard' + self.shard if self.shard else ''}-v{LAYOUT}"

    def _path(self, layer: int) -> pathlib.Path:
        return self.dir / f"layer-{layer:04d}.safetensors"

    def _formats(self, fmts: tuple[str, str] | None) -> tuple[str, str]:
        """A layer's (gate/up, down) formats: the cache's format for both unless told (gguf_model.layer_formats)."""
        return fmts or (self.fmt, self.fmt)

    def _meta(self, E: int, I: int, H: int, fmts: tuple[str, str]) -> dict[str, str]:
        """What a layer file must have been made from to be used (its metadata, less the checksums)."""
        Kp_h, Kp_i = native_moe.row_len(H, fmts[0]), native_moe.row_len(I, fmts[1])
        return {"fingerprint": self.fingerprint, "source": self.stamp, "format": "+".join(dict.fromkeys(fmts)),
                "layout": str(LAYOUT), "checksum": CHECKSUM, "shape": json.dumps([E, I, H, Kp_h, Kp_i])}

    def save(self, layer: int, op) -> None:
        """Write one layer's packed experts (atomically: temporary name, fsync, rename)."""
        tensors = dict(sorted(_tensors(op).items(), key=lambda kv: not kv[0].endswith(".data")))
        meta = {**self._meta(op.num_experts, op.intermediate, op.hidden, (op.fmt, op.down_fmt)),
                "hashes": json.dumps({k: chunk_hashes(t) for k, t in tensors.items()})}
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self._path(layer)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            write_safetensors(tmp, tensors, meta)
            os.replace(tmp, final)
        except OSError as e:  # a full or read-only disk costs the next start time, not this one its model
            log.warning("could not write the packed-weight cache %s: %s", final, e)
            tmp.unlink(missing_ok=True)

    def load(self, layer: int, E: int, I: int, H: int, threads: int, fmts: tuple[str, str] | None = None):
        """-> the layer's NativeMoELayer from the cache, or None (absent, stale, truncated or corrupt: logged).
        fmts: its (gate/up, down) formats where they are not both the cache's."""
        path = self._path(layer)
        if not path.exists():
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            log.warning("packed-weight cache %s is unreadable (%s): rebuilding it", path, e)
            return None
        try:
            return self._read(fd, path, E, I, H, threads, self._formats(fmts))
        except Exception as e:  # not safetensors, wrong names or shapes...: never trusted
            log.warning("packed-weight cache %s is unreadable (%s): rebuilding it", path, e)
            return None
        finally:
            os.close(fd)

    def _spans(self, fd: int, path: pathlib.Path, E: int, I: int, H: int, fmts: tuple[str, str],
               then: str = "rebuilding it"):
        """-> (file size, layout, name -> (offset, bytes), checksums) of a layer file made for this model and
        format, None if stale (logged, with what happens `then`); ValueError if it is not one."""
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if not 2 <= n <= 1 << 24:
            raise ValueError(f"header length {n}")
        header = json.loads(os.pread(fd, n, 8))
        meta = header.pop("__metadata__", {})
        stale = [k for k, v in self._meta(E, I, H, fmts).items() if meta.get(k) != v]
        if stale:
            log.warning("packed-weight cache %s is stale (%s differ): %s", path, ", ".join(stale), then)
            return None
        want, hashes = _layout(E, I, H, fmts), json.loads(meta["hashes"])
        if set(header) != set(want) or set(hashes) != set(want):
            raise ValueError(f"tensors {sorted(header)}, this layout has {sorted(want)}")
        size = os.fstat(fd).st_size
        data_end = 8 + n + max(h["data_offsets"][1] for h in header.values())
        if size != data_end:
            raise ValueError(f"{size} bytes, the header describes {data_end} (truncated?)")
        spans = {}  # name -> (file offset, bytes)
        for name, (shape, dtype) in want.items():
            h, nbytes = header[name], math.prod(shape) * dtype.itemsize
            if h["dtype"] != ST_DTYPES[dtype] or h["shape"] != list(shape) or \
                    h["data_offsets"][1] - h["data_offsets"][0] != nbytes:
                raise ValueError(f"{name}: {h['dtype']} {h['shape']}, this layout has {ST_DTYPES[dtype]} {list(shape)}")
            if len(hashes[name]) != -(-nbytes // CHUNK):
                raise ValueError(f"{name}: {len(hashes[name])} checksums for {nbytes} bytes")
            spans[name] = (8 + n + h["data_offsets"][0], nbytes)
        return size, want, spans, hashes

    def map_layer(self, layer: int, E: int, I: int, H: int, threads: int, fmts: tuple[str, str] | None = None):
        """Another process's view of a layer the expert service holds (the GPU side's prefill): the file mapped
        read-only, unlocked and unchecked (its owner checked and locked it; the page cache holds one copy for
        both) -> NativeMoELayer over it, or None (absent, stale or not a layer file: logged)."""
        path = self._path(layer)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fmts = self._formats(fmts)
            found = self._spans(fd, path, E, I, H, fmts, then="not used")
            if found is None:
                return None
            size, want, spans, _ = found
            m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except (OSError, ValueError) as e:
            log.warning("packed-weight cache %s cannot be mapped: %s", path, e)
            return None
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only memory: the kernels never write weights
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            t = {name: torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=off).view(dtype).view(shape)
                 for name, (off, nbytes) in spans.items() for shape, dtype in [want[name]]}
        parts = {g: tuple(t.get(f"{g}.{p}") for p in PARTS) for g in ("gu", "dn")}
        return native_moe.NativeMoELayer.wrap(E, I, H, fmts[0], parts["gu"], parts["dn"], threads, down_fmt=fmts[1])

    def _read(self, fd: int, path: pathlib.Path, E: int, I: int, H: int, threads: int, fmts: tuple[str, str]):
        found = self._spans(fd, path, E, I, H, fmts)
        if found is None:
            return None
        size, want, spans, hashes = found
        empty = lambda: _tensors(native_moe.NativeMoELayer.empty(E, I, H, fmts[0], down_fmt=fmts[1]))  # noqa: E731
        tensors = _reader()(fd, size, want, spans, hashes, empty)
        if tensors is None:
            log.warning("packed-weight cache %s is corrupt (checksum mismatch): rebuilding it", path)
            return None
        parts = {m: tuple(tensors.get(f"{m}.{p}") for p in PARTS) for m in ("gu", "dn")}
        return native_moe.NativeMoELayer.wrap(E, I, H, fmts[0], parts["gu"], parts["dn"], threads, down_fmt=fmts[1])

    def sweep(self) -> None:
        """Remove temporary files of writers that died (their pid is gone)."""
        if not self.dir.is_dir():
            return
        for f in self.dir.glob(".*.tmp-*"):
            pid = f.name.rsplit("-", 1)[-1]
            if pid.isdigit() and not _alive(int(pid)):
                f.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

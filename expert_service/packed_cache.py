"""The packed-weight cache: a layer's experts as the native kernels hold them (packed rows, scales),
written once and read back on later starts instead of re-reading and re-quantizing the checkpoint.

One safetensors file per MoE layer in `<cache dir>/<fingerprint>-<format>-v<LAYOUT>/`, written to a
temporary name and renamed into place (a crash leaves no half-written layer under its real name).
Each file carries in its metadata what it was made from and a CRC-32 of every 64 MiB chunk of every
tensor; a layer is used only if all of it matches (same model fingerprint, same source files by size
and mtime, same format, same packing layout, same shapes, every byte as written). Anything else is
logged and rebuilt, never trusted. Reading goes straight into the kernels' huge-page buffers with
pread (no memory map: the file's pages never count in the RSS), chunks in parallel with their checks.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import struct
import zlib

import torch

from moe_core.checkpoint import Checkpoint

from .kernels import native_moe

log = logging.getLogger("expert_service.cache")

# Bump whenever the packed layout changes (row padding, int4 nibble order, scales): old caches are
# then stale by key, never misread.
LAYOUT = 1
PARTS = ("data", "scale", "rowsum", "rowcorr")
CHUNK = 64 << 20  # bytes per checksum, and per read task
READERS = 2       # parallel pread + CRC tasks (both release the GIL)


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
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors.values():
            if t.numel():
                f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _bytes(t: torch.Tensor):
    return t.view(torch.uint8).reshape(-1).numpy()


def chunk_crcs(t: torch.Tensor) -> list[int]:
    b = _bytes(t)
    return [zlib.crc32(b[i:i + CHUNK]) for i in range(0, len(b), CHUNK)]


def _tensors(op) -> dict[str, torch.Tensor]:
    return {f"{m}.{p}": t for m, parts in (("gu", op.gu), ("dn", op.dn)) for p, t in zip(PARTS, parts)
            if t is not None}


@dataclasses.dataclass
class PackedCache:
    root: pathlib.Path
    fingerprint: str
    stamp: str
    fmt: str

    @property
    def dir(self) -> pathlib.Path:
        return self.root / f"{self.fingerprint}-{self.fmt}-v{LAYOUT}"

    def _path(self, layer: int) -> pathlib.Path:
        return self.dir / f"layer-{layer:04d}.safetensors"

    def _meta(self, E: int, I: int, H: int) -> dict[str, str]:
        """What a layer file must have been made from to be used (its metadata, less the checksums)."""
        Kp_h, Kp_i = native_moe.row_len(H, self.fmt), native_moe.row_len(I, self.fmt)
        return {"fingerprint": self.fingerprint, "source": self.stamp, "format": self.fmt, "layout": str(LAYOUT),
                "shape": json.dumps([E, I, H, Kp_h, Kp_i])}

    def save(self, layer: int, op) -> None:
        """Write one layer's packed experts (atomically: temporary name, fsync, rename)."""
        tensors = _tensors(op)
        meta = {**self._meta(op.num_experts, op.intermediate, op.hidden), "crc32": json.dumps({k: chunk_crcs(t) for k, t in tensors.items()})}
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self._path(layer)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            write_safetensors(tmp, tensors, meta)
            os.replace(tmp, final)
        except OSError as e:  # a full or read-only disk costs the next start time, not this one its model
            log.warning("could not write the packed-weight cache %s: %s", final, e)
            tmp.unlink(missing_ok=True)

    def load(self, layer: int, E: int, I: int, H: int, threads: int):
        """-> the layer's NativeMoELayer from the cache, or None (absent, stale, truncated or corrupt: logged)."""
        path = self._path(layer)
        if not path.exists():
            return None
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            log.warning("packed-weight cache %s is unreadable (%s): rebuilding it", path, e)
            return None
        try:
            return self._read(fd, path, E, I, H, threads)
        except Exception as e:  # not safetensors, wrong names or shapes...: never trusted
            log.warning("packed-weight cache %s is unreadable (%s): rebuilding it", path, e)
            return None
        finally:
            os.close(fd)

    def _read(self, fd: int, path: pathlib.Path, E: int, I: int, H: int, threads: int):
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if not 2 <= n <= 1 << 24:
            raise ValueError(f"header length {n}")
        header = json.loads(os.pread(fd, n, 8))
        meta = header.pop("__metadata__", {})
        stale = [k for k, v in self._meta(E, I, H).items() if meta.get(k) != v]
        if stale:
            log.warning("packed-weight cache %s is stale (%s differ): rebuilding it", path, ", ".join(stale))
            return None
        op = native_moe.NativeMoELayer.empty(E, I, H, self.fmt)
        dst, crcs = _tensors(op), json.loads(meta["crc32"])
        if set(header) != set(dst) or set(crcs) != set(dst):
            raise ValueError(f"tensors {sorted(header)}, this layout has {sorted(dst)}")
        data_end = 8 + n + max(h["data_offsets"][1] for h in header.values())
        if os.fstat(fd).st_size != data_end:
            raise ValueError(f"{os.fstat(fd).st_size} bytes, the header describes {data_end} (truncated?)")
        tasks = []
        for name, t in dst.items():
            h = header[name]
            if h["dtype"] != ST_DTYPES[t.dtype] or h["shape"] != list(t.shape) or \
                    h["data_offsets"][1] - h["data_offsets"][0] != t.nbytes:
                raise ValueError(f"{name}: {h['dtype']} {h['shape']}, this layout has {ST_DTYPES[t.dtype]} "
                                 f"{list(t.shape)}")
            buf = _bytes(t)
            if len(crcs[name]) != -(-len(buf) // CHUNK):
                raise ValueError(f"{name}: {len(crcs[name])} checksums for {len(buf)} bytes")
            for i, crc in enumerate(crcs[name]):
                tasks.append((buf[i * CHUNK:(i + 1) * CHUNK], 8 + n + h["data_offsets"][0] + i * CHUNK, crc))

        def read(task) -> bool:
            view, off, crc = task
            got = os.preadv(fd, [view], off)
            return got == len(view) and zlib.crc32(view) == crc

        with concurrent.futures.ThreadPoolExecutor(READERS) as ex:
            if not all(ex.map(read, tasks)):
                log.warning("packed-weight cache %s is corrupt (checksum mismatch): rebuilding it", path)
                return None
        op.ready(threads)
        return op

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

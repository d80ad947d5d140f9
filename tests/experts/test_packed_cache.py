"""The packed-weight cache: a warm start reads what a cold one packed, bit for bit; a stale, truncated,
corrupted or foreign cache is detected and rebuilt, never trusted; `expert-service convert` packs
offline; a writer that died leaves no half-written layer."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from harness import ROOT, free_port, start
from moe_experts.kernels import NATIVE_ISA
from moe_experts.packed_cache import PackedCache, source_stamp
from moe_experts.store import load_expert_layers
from moe_core.checkpoint import Checkpoint
from moe_core.config import load_config
from moe_core.fingerprint import fingerprint

pytestmark = pytest.mark.skipif(NATIVE_ISA is None, reason="the cache holds the native kernels' layout")


def layers_of(d, fmt, cache):
    return load_expert_layers(load_config(d), Checkpoint(d), fmt, 1, cache=cache)


def cache_for(d, root, fmt):
    ck = Checkpoint(d)
    return PackedCache(pathlib.Path(root), fingerprint(ck), source_stamp(ck), fmt)


def packed(op) -> list[torch.Tensor]:
    return [t for t in (*op.gu, *op.dn) if t is not None]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        all(torch.equal(x, y) for x, y in zip(packed(a[k]), packed(b[k]))) for k in a)


@pytest.fixture(params=["map", "pread"])
def reader(request, monkeypatch):
    """Both ways a layer file is read: mapped in place (one NUMA node) and into node-bound buffers."""
    from moe_experts import packed_cache
    monkeypatch.setattr(packed_cache, "_reader", lambda: getattr(packed_cache, f"_{request.param}"))
    monkeypatch.setattr(packed_cache, "_lock", lambda m: True)  # whatever RLIMIT_MEMLOCK allows here
    return request.param


@pytest.mark.parametrize("family, fmt", [("deepseek_v3", "bf16"), ("deepseek_v3", "int8"), ("deepseek_v3", "int4"),
                                         ("gpt_oss", "mxfp4")])  # gpt-oss: and its expert biases, read each start
def test_warm_load_is_the_cold_load_bit_for_bit(checkpoints, tmp_path, family, fmt, reader, caplog):
    d = checkpoints[family]
    cfg = load_config(d)
    cold = layers_of(d, fmt, cache_for(d, tmp_path, fmt))
    files = sorted(cache_for(d, tmp_path, fmt).dir.glob("layer-*.safetensors"))
    assert len(files) == len(cold)
    caplog.set_level("INFO")
    warm = layers_of(d, fmt, cache_for(d, tmp_path, fmt))
    assert same(cold, warm)
    assert f"{len(cold)} from the packed-weight cache" in caplog.text
    E, k = cfg.n_routed_experts, cfg.top_k
    x, ids, w = torch.randn(3, 64), torch.randint(0, E, (3, k), dtype=torch.int32), torch.rand(3, k)
    for layer in cold:
        assert torch.equal(cold[layer].forward(x, ids, w), warm[layer].forward(x, ids, w))
        assert (warm[layer].biases[0] is not None) == cfg.expert_bias


def file_mappings() -> list[tuple[int, int, str]]:
    """(start, end, path) of this process's mappings of .safetensors files."""
    out = []
    for line in open("/proc/self/maps"):
        f = line.split()
        if len(f) >= 6 and f[5].endswith(".safetensors"):
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b, f[5]))
    return out


def test_warm_load_reads_the_weights_in_place(checkpoints, tmp_path, monkeypatch):
    """On one NUMA node the weights are the layer file's mapped pages (page-aligned), not a copy."""
    from moe_experts import packed_cache
    monkeypatch.setattr(packed_cache, "_reader", lambda: packed_cache._map)
    monkeypatch.setattr(packed_cache, "_lock", lambda m: True)  # whatever RLIMIT_MEMLOCK allows here
    d = checkpoints["deepseek_v3"]
    layers_of(d, "int8", cache_for(d, tmp_path, "int8"))
    warm = layers_of(d, "int8", cache_for(d, tmp_path, "int8"))
    maps = file_mappings()
    for layer, op in warm.items():
        for t in packed(op):
            ptr = t.data_ptr()
            hit = [m for m in maps if m[0] <= ptr and ptr + t.nbytes <= m[1]]
            assert hit and hit[0][2].endswith(f"layer-{layer:04d}.safetensors")
        assert op.gu[0].data_ptr() % 4096 == 0


def test_mapped_layers_are_locked_or_read_instead(checkpoints, tmp_path, monkeypatch, caplog):
    """Mapped weights are pinned (mlock) so memory pressure cannot evict them; where the limit forbids
    it, the layer is read into memory instead, with a warning that says how to allow it."""
    import ctypes

    from moe_experts import packed_cache
    monkeypatch.setattr(packed_cache, "_can_lock", True)
    d = checkpoints["deepseek_v3"]
    cold = layers_of(d, "int4", cache_for(d, tmp_path, "int4"))
    caplog.set_level("INFO")
    warm = layers_of(d, "int4", cache_for(d, tmp_path, "int4"))
    locked_kib = int(next(ln for ln in open("/proc/self/status") if ln.startswith("VmLck")).split()[1])
    if packed_cache._can_lock:  # this machine allows it: the weights are locked
        assert locked_kib * 1024 >= sum(t.nbytes for op in warm.values() for t in packed(op))
    else:
        assert "cannot lock the mapped packed-weight cache" in caplog.text
    assert same(cold, warm)

    class NoLock:  # as under Docker's default RLIMIT_MEMLOCK
        @staticmethod
        def mlock(ptr, size):
            ctypes.set_errno(12)
            return -1
    monkeypatch.setattr(packed_cache, "_libc", NoLock)
    monkeypatch.setattr(packed_cache, "_can_lock", True)
    caplog.clear()
    again = layers_of(d, "int4", cache_for(d, tmp_path, "int4"))
    assert "cannot lock the mapped packed-weight cache" in caplog.text and "memlock" in caplog.text
    assert caplog.text.count("cannot lock") == 1  # said once; later layers go straight to reading
    assert same(cold, again) and f"{len(cold)} from the packed-weight cache" in caplog.text
    maps = file_mappings()  # read, not mapped: no weight lies in a mapping of a layer file
    assert not any(a <= t.data_ptr() < b for op in again.values() for t in packed(op) for a, b, _ in maps)


def damage_truncate(f: pathlib.Path):
    with open(f, "r+b") as h:
        h.truncate(f.stat().st_size // 2)


def damage_flip(f: pathlib.Path):
    with open(f, "r+b") as h:
        h.seek(f.stat().st_size - 100)
        b = h.read(1)
        h.seek(-1, 1)
        h.write(bytes([b[0] ^ 0x40]))


def damage_garbage(f: pathlib.Path):
    f.write_bytes(os.urandom(4096))


@pytest.mark.parametrize("damage,word", [(damage_truncate, "unreadable"), (damage_flip, "corrupt"),
                                         (damage_garbage, "unreadable")])
def test_damaged_cache_is_rebuilt_not_trusted(checkpoints, tmp_path, damage, word, reader, caplog):
    d = checkpoints["deepseek_v3"]
    cold = layers_of(d, "int4", cache_for(d, tmp_path, "int4"))
    victim = sorted(cache_for(d, tmp_path, "int4").dir.glob("layer-*.safetensors"))[0]
    damage(victim)
    caplog.set_level("INFO")
    again = layers_of(d, "int4", cache_for(d, tmp_path, "int4"))
    assert word in caplog.text and str(victim) in caplog.text
    assert same(cold, again)
    caplog.clear()
    layers_of(d, "int4", cache_for(d, tmp_path, "int4"))  # rewritten whole: all hits now
    assert f"{len(cold)} from the packed-weight cache" in caplog.text


def test_stale_cache_is_rebuilt(checkpoints, tmp_path, caplog):
    """A changed checkpoint file (size or mtime), another layout or another format never hits."""
    src = pathlib.Path(checkpoints["qwen3_moe"])
    d = tmp_path / "model"
    d.mkdir()
    for f in src.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    layers_of(d, "int8", cache_for(d, tmp_path / "c", "int8"))
    shard = next(d.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))  # "re-downloaded"
    caplog.set_level("INFO")
    layers_of(d, "int8", cache_for(d, tmp_path / "c", "int8"))
    assert "is stale (source differ)" in caplog.text and "0 from the packed-weight cache" in caplog.text


def test_leftover_temporary_files_are_swept(checkpoints, tmp_path):
    d = checkpoints["qwen3_moe"]
    c = cache_for(d, tmp_path, "bf16")
    c.dir.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = c.dir / f".layer-0000.safetensors.tmp-{dead.pid}"
    stale.write_bytes(b"half a layer")
    layers_of(d, "bf16", c)
    assert not stale.exists()
    assert not list(c.dir.glob(".*tmp*"))


def test_convert_offline_then_serve_from_it(checkpoints, tmp_path):
    d = checkpoints["deepseek_v3"]
    out = tmp_path / "packed"
    p = subprocess.run([sys.executable, "-m", "expert_service", "convert", "--model", str(d), "--weight-format",
                        "int4", "--out", str(out), "--threads", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert "packed 2 MoE layers as int4" in p.stdout
    log = tmp_path / "expert.log"
    proc = start("expert_service", "--model", str(d), "--listen", f"127.0.0.1:{free_port()}", "--threads", "1",
                 "--weight-format", "int4", "--cache-dir", str(out), log=log)
    try:
        deadline = time.monotonic() + 60
        while "ready:" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "2 from the packed-weight cache" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)

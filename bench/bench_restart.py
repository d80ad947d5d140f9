"""Expert-service start-up: time to SERVING and memory, cold (nothing cached), warm (packed-weight
cache in the page cache) and after the page cache of the checkpoint and the cache files was dropped,
against the floor of reading the same cache bytes from the same state, and (--llama-work, a Qwen3-MoE
checkpoint) against llama.cpp loading the same weights as GGUF (bf16 / Q8_0 / Q4_0 for our bf16 /
int8 / int4) from the same state, measured in the same run.

    python bench/bench_restart.py --synth qwen3-30b-a3b --layers 6 --weight-format int4 bf16
    python bench/bench_restart.py --model DIR --weight-format int8 --llama-work /tmp/moe-llamacpp

Page caches are dropped per file (posix_fadvise DONTNEED), which needs no privileges. Each row is the
median of --reps starts; the cold start runs once per format (it writes the cache). llama.cpp's load
is timed as the wall time of llama-bench -p 0 -n 1 (start, mmap of the whole GGUF with MAP_POPULATE,
one warm-up and one timed token: ~0.1 s of compute); its build and GGUFs come from
bench_llamacpp.py's --work folder (built or written there when missing)."""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from common import cpu_name, peer_env  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))


def drop_file(f: pathlib.Path) -> None:
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def drop_page_cache(*dirs: pathlib.Path) -> None:
    for d in dirs:
        for f in d.rglob("*"):
            if f.is_file():
                drop_file(f)


def read_all(d: pathlib.Path) -> float:
    """Seconds to read every byte under d sequentially (the I/O floor of a start that reads them)."""
    t0 = time.perf_counter()
    for f in sorted(d.rglob("*.safetensors")):
        with open(f, "rb", buffering=0) as h:
            while h.readinto(buf):
                pass
    return time.perf_counter() - t0


buf = bytearray(16 << 20)


def status_mib(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1)) / 1024


def start(model: pathlib.Path, fmt: str, cache: pathlib.Path, threads: int) -> dict:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "expert_service", "--model", str(model), "--listen", "127.0.0.1:0",
                          "--threads", str(threads), "--weight-format", fmt, "--cache-dir", str(cache)],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True)
    hits = None
    for line in p.stderr:
        m = re.search(r"\((\d+) from the packed-weight cache", line)
        if m:
            hits = int(m.group(1))
        if "ready:" in line:
            break
    else:
        raise RuntimeError(f"expert service exited with {p.wait()}")
    out = {"s": time.perf_counter() - t0, "peak": status_mib(p.pid, "VmHWM"), "steady": status_mib(p.pid, "VmRSS"),
           "hits": hits}
    p.terminate()
    p.wait(60)
    return out


def llama_load(bench: pathlib.Path, gguf: pathlib.Path, threads: int) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", "1", "-r", "1"],
                   check=True, capture_output=True, env=peer_env())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth", help="write a synthetic checkpoint of this architecture (tools/synth_checkpoint.py)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--weight-format", nargs="+", default=["int4"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-work", type=pathlib.Path,
                    help="bench_llamacpp.py's --work folder: also time llama.cpp's load of the same weights")
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-restart-"))
    try:
        model = a.model
        if a.synth:
            import synth_checkpoint
            t0 = time.perf_counter()
            model = synth_checkpoint.write(synth_checkpoint.config_of(a.synth, a.layers, {}), work / "model",
                                           std=0.02, seed=0, shard_mb=4096)
            print(f"wrote {a.synth} with {a.layers} layers in {time.perf_counter() - t0:.0f}s")
        size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
        print(f"CPU: {cpu_name()}; checkpoint {model} ({size:.1f} GiB); threads {a.threads}")
        llama = src = None
        if a.llama_work:
            import bench_llamacpp
            a.llama_work.mkdir(parents=True, exist_ok=True)
            src = bench_llamacpp.build_llama(a.llama_work, "avx2")
            llama = src / "build-avx2" / "bin" / "llama-bench"
        print("format  start                 to SERVING (s)  cache hits  peak RSS (MiB)  steady RSS (MiB)  "
              "read floor (s)  llama.cpp load (s)")
        for fmt in a.weight_format:
            cache = work / f"cache-{fmt}"
            gg = None
            if llama:
                qtype = {"bf16": "bf16", "int8": "Q8_0", "int4": "Q4_0"}[fmt]
                gg = bench_llamacpp.gguf(model, src, "avx2", a.llama_work, qtype)
                drop_file(gg)
            cold = start(model, fmt, cache, a.threads)
            packed = sum(f.stat().st_size for f in cache.rglob("*.safetensors")) / 2**30
            rows = [("cold (packs, writes)", [cold], None, None)]
            warm, dropped, floor_warm, floor_cold, ll_warm, ll_cold = [], [], [], [], [], []
            for _ in range(a.reps):  # interleaved: floor, start, llama.cpp, in each state
                floor_warm.append(read_all(cache))
                warm.append(start(model, fmt, cache, a.threads))
                drop_page_cache(model, cache)
                floor_cold.append(read_all(cache))
                drop_page_cache(model, cache)
                dropped.append(start(model, fmt, cache, a.threads))
                if gg:
                    ll_cold.append(llama_load(llama, gg, a.threads))
                    ll_warm.append(llama_load(llama, gg, a.threads))
                    drop_file(gg)  # the next round's warm start finds only our files warm
            rows += [("warm restart", warm, floor_warm, ll_warm), ("page cache dropped", dropped, floor_cold, ll_cold)]
            for name, runs, floor, ll in rows:
                med = lambda k: statistics.median(r[k] for r in runs)  # noqa: E731
                fl = f"{statistics.median(floor):.2f}" if floor else "-"
                lc = f"{statistics.median(ll):.2f}" if ll else "-"
                print(f"{fmt:6}  {name:22}{med('s'):14.2f}  {runs[0]['hits']!s:>10}  {med('peak'):14.0f}  "
                      f"{med('steady'):16.0f}  {fl:>14}  {lc:>18}")
            gsize = f"; GGUF {gg.stat().st_size / 2**30:.2f} GiB" if gg else ""
            print(f"{fmt:6}  packed cache: {packed:.2f} GiB{gsize}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

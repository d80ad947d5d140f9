"""Both services on a published architecture at full width (a synthetic checkpoint from
tools/synth_checkpoint.py, or --model DIR): time to SERVING (cold: nothing cached; warm: packed-weight
cache and page cache warm), peak and steady RSS of each service, time to first token for 512- and
8192-token prompts, and decode tokens/s, with the DRAM roofline of decode measured in the same run.

    python bench/bench_real.py --synth qwen3-30b-a3b --layers 6 --weight-format int4
    python bench/bench_real.py --model DIR --weight-format int8 --prompts 512

Both services share the machine's cores (the CPU-only set-up); each number is the median of --reps."""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import tempfile
import time

from common import cpu_name, free_port, generate, start, status_mib, wait_healthy  # noqa: E402


def up(model, fmt, cache, threads, tmp, tag, dense="auto") -> tuple[dict, object, object, float]:
    ep, gp = free_port(), free_port()
    env = {"MOE_CACHE_DIR": str(cache), "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    e = start("expert_service", "--model", str(model), "--listen", f"127.0.0.1:{ep}", "--threads", str(threads),
              "--weight-format", fmt, log=tmp / f"expert-{tag}.log", env=env)
    g = start("gpu_service", "--model", str(model), "--experts", f"127.0.0.1:{ep}", "--listen", f"127.0.0.1:{gp}",
              "--threads", str(threads), "--device", "cpu", "--dense-format", dense, log=tmp / f"gpu-{tag}.log",
              env=env)
    wait_healthy(ep, e, timeout=3600)
    wait_healthy(gp, g, timeout=3600)
    return {"port": gp}, e, g, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=pathlib.Path)
    src.add_argument("--synth")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--weight-format", default="int4")
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 8192])
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long-reps", type=int, default=1, help="repetitions of prompts over 2048 tokens (minutes each)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--dense-format", nargs="+", default=["auto"],
                    help="gpu-service --dense-format; several: one warm run each (e.g. torch bf16 int8)")
    a = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-real-"))
    procs = []
    try:
        model = a.model
        if a.synth:
            import synth_checkpoint
            model = synth_checkpoint.write(synth_checkpoint.config_of(a.synth, a.layers, {}), work / "model",
                                           std=0.02, seed=0, shard_mb=4096)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors")) / 2**30
        print(f"CPU: {cpu_name()}; {model.name if a.model else a.synth} ({size:.1f} GiB), experts {a.weight_format}, "
              f"{a.threads} threads per service (shared cores)")
        cache = work / "cache"
        runs_of = [("cold", a.dense_format[0])] + [("warm", d) for d in a.dense_format]
        for tag, dense in runs_of:
            svc, e, g, ready = up(model, a.weight_format, cache, a.threads, work, f"{tag}-{dense}", dense)
            procs = [e, g]
            mem = {name: (status_mib(p.pid, "VmHWM"), status_mib(p.pid, "VmRSS")) for name, p in
                   (("expert", e), ("gpu", g))}
            print(f"{tag:5} start (dense layers: {dense}): both SERVING in {ready:.1f}s; expert RSS peak {mem['expert'][0]:.0f} / steady "
                  f"{mem['expert'][1]:.0f} MiB; gpu RSS peak {mem['gpu'][0]:.0f} / steady {mem['gpu'][1]:.0f} MiB")
            if tag == "warm":
                for n in a.prompts:
                    prompt = [(i * 7919) % 4000 + 2 for i in range(n)]
                    generate(svc["port"], prompt[:16], 4)  # warm-up
                    runs = [generate(svc["port"], prompt, a.decode_tokens)
                            for _ in range(a.reps if n <= 2048 else a.long_reps)]
                    ttft = statistics.median(r[0] for r in runs)
                    dec = statistics.median(r[1] for r in runs)
                    print(f"prompt {n:5}: time to first token {ttft:.2f}s ({n / ttft:.0f} prompt tok/s), "
                          f"decode {dec:.2f} tok/s after it")
                steady = {name: status_mib(p.pid, "VmRSS") for name, p in (("expert", e), ("gpu", g))}
                print(f"after the prompts: expert RSS {steady['expert']:.0f} MiB, gpu RSS {steady['gpu']:.0f} MiB")
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
            procs = []
    finally:
        for p in procs:
            p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

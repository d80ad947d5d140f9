"""Sharing the machine: decode tokens/s through both services (real processes, their default
thread counts) quiet, and with 1 and 2 busy processes beside them (each a single-threaded Python
loop), in interleaved rounds within one run; each loaded figure is reported as a share of the quiet
one measured in the same rounds.

    python bench/bench_sharing.py [--model models/default] [--tokens 64] [--rounds 5] [--busy 0,1,2]
                                  [--gpu-args "..."] [--expert-args "..."]

With n busy processes the scheduler's share for one more process is 1 / (1 + n) of the machine:
the bar is to degrade about in proportion (issue #14: >= 45% of quiet with one, >= 30% with two).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT, decode_rate, Services  # noqa: E402
from moe_core import serving  # noqa: E402
from protos import generate_pb2  # noqa: E402

BUSY = "while True: pass"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "default"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--busy", default="0,1,2", help="numbers of busy processes to measure (0 = quiet)")
    ap.add_argument("--gpu-args", default="", help="extra gpu-service flags")
    ap.add_argument("--expert-args", default="", help="extra expert-service flags")
    ap.add_argument("--gpu-env", default="", help="KEY=VALUE ... for the gpu-service process")
    ap.add_argument("--expert-env", default="", help="KEY=VALUE ... for the expert-service process")
    a = ap.parse_args()
    busy_counts = [int(n) for n in a.busy.split(",")]
    cores = serving.physical_cores()
    # the services' own defaults (the test fixture pins 1 thread each; undo that)
    svc = Services(a.model, pathlib.Path(tempfile.mkdtemp()),
                   gpu_args=("--threads", str(cores), *shlex.split(a.gpu_args)),
                   expert_args=("--threads", str(cores), *shlex.split(a.expert_args)),
                   gpu_prefix=("env", *shlex.split(a.gpu_env)), expert_prefix=("env", *shlex.split(a.expert_env)))
    req = generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=list(range(2, 18))), max_tokens=a.tokens,
                                       ignore_eos=True, sampling=generate_pb2.SamplingParams(temperature=0))
    rates: dict[int, list[float]] = {n: [] for n in busy_counts}
    try:
        list(svc.stub.Generate(req, timeout=600))  # warm-up
        for _ in range(a.rounds):
            for n in busy_counts:
                hogs = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(n)]
                try:
                    time.sleep(0.3)  # the hogs are running
                    rates[n].append(decode_rate(list(svc.stub.Generate(req, timeout=600))))
                finally:
                    for h in hogs:
                        h.kill()
                        h.wait()
    finally:
        svc.stop()
    quiet = statistics.median(rates[0]) if 0 in rates else None
    rows = []
    for n in busy_counts:
        row = {"busy_processes": n, "decode_tok_s": round(statistics.median(rates[n]), 1),
               "runs": [round(r, 1) for r in rates[n]], "cores": cores, "cpu": os.uname().machine}
        if quiet and 0 in rates:
            # per round against that round's quiet run, then the median
            row["share_of_quiet"] = round(statistics.median(r / q for r, q in zip(rates[n], rates[0])), 3)
            row["one_process_share"] = round(1 / (1 + n), 3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| busy processes | decode tok/s | share of quiet | one process's share |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['busy_processes']} | {r['decode_tok_s']} | {r.get('share_of_quiet', '')} | {r.get('one_process_share', '')} |")


if __name__ == "__main__":
    main()

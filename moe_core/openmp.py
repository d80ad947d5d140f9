"""OpenMP's wait policy for torch's threads, set before torch loads libgomp (which reads it once).

libgomp's default keeps every OpenMP thread spinning for a while after each parallel region. On a
host shared with the other service or with other programs, those spins take cores from threads
that have work: decode through both services with one busy process beside them fell to 37% of
quiet, 11% with two (bench/bench_sharing.py); passive waiting holds it near the quiet figure.
OMP_WAIT_POLICY=active in the environment restores spinning (a machine of its own, many ops).
"""
import os


def passive_by_default() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

"""OpenMP's wait policy for torch's threads, set before torch loads libgomp (which reads it once).

libgomp's default keeps every OpenMP thread spinning for a while after each parallel region. On a
host shared with the other service or with other programs, those spins take cores from threads
that have work: decode through both services with one busy process beside them fell to 37% of
quiet, 11% with two (bench/bench_sharing.py); passive waiting holds it near the quiet figure.
OMP_WAIT_POLICY=active in the environment restores spinning (a machine of its own, many ops).
"""
import os


_SET_HERE = False  # whether passive_by_default set it (rather than the user's environment)


def passive_by_default() -> None:
    global _SET_HERE
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        _SET_HERE = True


def environ_for_others() -> dict[str, str]:
    """os.environ as another program started from here should see it: without the wait policy set for our own torch
    (importing gpu_service or expert_service sets it). llama.cpp's OpenMP threads waiting passively decode ~1.6x
    slower at 48 layers on 2 cores, so a benchmark against it must not pass ours on (docs/performance/kernels.md)."""
    env = dict(os.environ)
    if _SET_HERE:
        env.pop("OMP_WAIT_POLICY", None)
    return env

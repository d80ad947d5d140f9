"""The native kernels both services import: the C++ library in native/ (as `native`), the kernel
path (the instruction set, ISA) this CPU runs, and the packed weight formats.

    native/ (C++)  ->  moe_kernels (this package: ISA choice, packing, dense layers)
                         <- moe_experts.kernels (routed experts: NativeMoELayer, ring)
                         <- gpu_service (dense layers on the CPU, shared-memory doorbells)

The ISA (ISAS: portable | avx2 | avxvnni | avx512 | amx) is chosen at import from CPUID and
the OS's XSAVE state (amx: also the OS's grant of the tile state), or forced with MOE_KERNEL_PATH.
"""
from __future__ import annotations

import logging
import os

from . import _native as native

log = logging.getLogger("moe_kernels")

# every kernel path, slowest first; avxvnni is avx2 with vpdpbusd on ymm for the int formats
ISAS = ("portable", "avx2", "avxvnni", "avx512", "amx")
SIMD_ISAS = ISAS[1:]


def choose_isa() -> str:
    forced = os.environ.get("MOE_KERNEL_PATH")
    if forced and forced != "torch":
        if not native.isa_supported(forced):
            raise RuntimeError(f"MOE_KERNEL_PATH={forced} cannot run on this CPU/OS (features: {native.cpu_features()})")
        return forced
    return native.best_isa()


ISA = choose_isa()
log.info("native kernel path: %s; NUMA: %s", ISA, native.numa_topology())

"""Builds the native kernel extension (moe_kernels/_native). Metadata lives in pyproject.toml.
No -march=native: per-ISA functions carry target attributes and are chosen at run time.
MOE_ASAN=1 builds it with AddressSanitizer (run Python with LD_PRELOAD=$(gcc -print-file-name=libasan.so));
tests/e2e/test_isolation.py does that in a scratch folder (asan_native)."""
import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# the sources compile in parallel, one job per CPU (MOE_BUILD_JOBS=N to choose): setuptools compiles one
# extension's files one after another (8 minutes for the ASan build on a 2-core Zen 1)
ParallelCompile("MOE_BUILD_JOBS", default=0).install()

ASAN = os.environ.get("MOE_ASAN") == "1"
# -fno-var-tracking-assignments: the kernels' templates exceed GCC's variable-tracking limit, which it finds only after
# trying (then compiles them again without); ASan's reports keep their file:line
flags = ["-O1", "-g", "-fno-var-tracking-assignments", "-fsanitize=address", "-fno-omit-frame-pointer"] if ASAN else ["-O3"]

# native/'s folders (docs/architecture.md, "native/ layout"): every .cpp under it, its headers included by their path
# from native/ ("kernels/kernels.h"); the headers listed as the extension's dependencies, so a changed header rebuilds
SOURCES = sorted(glob.glob("native/**/*.cpp", recursive=True))
HEADERS = sorted(glob.glob("native/**/*.h", recursive=True))

setup(
    ext_modules=[Pybind11Extension("moe_kernels._native", SOURCES, include_dirs=["native"], cxx_std=17,
                                   extra_compile_args=flags,
                                   extra_link_args=["-fsanitize=address"] if ASAN else [], depends=HEADERS)],
    cmdclass={"build_ext": build_ext},
)

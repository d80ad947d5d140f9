"""Builds the native kernel extension (expert_service/_moe_native). Metadata lives in pyproject.toml.
No -march=native: per-ISA functions carry target attributes and are chosen at run time."""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[Pybind11Extension("expert_service._moe_native", sorted(glob.glob("native/*.cpp")),
                                   include_dirs=["native"], cxx_std=17, extra_compile_args=["-O3"])],
    cmdclass={"build_ext": build_ext},
)

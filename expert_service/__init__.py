"""The expert service: holds the routed experts of every MoE layer in DRAM and runs them on the CPU."""
from moe_core.openmp import passive_by_default

passive_by_default()  # before anything imports torch

"""The expert service: holds the routed experts of every MoE layer in DRAM and runs them on the CPU."""

"""The GPU side's model: every weight but the routed experts, and one step over a batch (step.py: the
stages of a layer, defined once; the per-op, native-loop and CUDA-graph runners compose them)."""

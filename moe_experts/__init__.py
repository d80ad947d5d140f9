"""The routed experts' library both services use: loading them from a checkpoint (store), the packed-weight
cache, the MoE layers that compute them (kernels: native or torch) and the weight-format policy (loading)."""

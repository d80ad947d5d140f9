"""Which of a token's experts are deferred: the one rule both services (and the accuracy
harness's skip mode) apply."""
import torch


def split_deferred(ids: torch.Tensor, weights: torch.Tensor, defer: int):
    """Per token, move the `defer` lowest-weighted experts out of the immediate set.
    ids [T, k], weights [T, k] -> (imm_ids [T, k-d], imm_w, def_ids [T, d], def_w).
    Stable for ties (the earlier slot stays immediate)."""
    order = torch.argsort(weights, dim=1, descending=True, stable=True)
    k = ids.shape[1]
    imm, dfr = order[:, : k - defer], order[:, k - defer:]
    return ids.gather(1, imm), weights.gather(1, imm), ids.gather(1, dfr), weights.gather(1, dfr)

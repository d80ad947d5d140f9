"""The row-blocked formats' storage order (native/kernels/gemm_blocked.h): a matrix's rows in blocks of BLOCK_ROWS (the last
may be shorter), each block's fields stored group by group with its rows side by side, so one vector load takes one
field of a whole block. Pure torch: moe_kernels.formats and moe_kernels.iq_formats pack through it."""
from __future__ import annotations

import torch

BLOCK_ROWS = 16  # the grouped int formats' row blocks


def _row_blocks(R: int) -> list[tuple[int, int, int, int]]:
    """(first row, rows, blocks, rows a block) of R rows' whole blocks of BLOCK_ROWS, then of the shorter last one."""
    full = R // BLOCK_ROWS * BLOCK_ROWS
    return [p for p in ((0, full, full // BLOCK_ROWS, BLOCK_ROWS), (full, R - full, 1, R - full)) if p[1]]


def _interleave_rows(*fields: torch.Tensor) -> torch.Tensor:
    """Fields [..., R, G, C_i, B_i] -> [..., R, G * sum(C_i B_i)]: rows in blocks of BLOCK_ROWS (the last may be
    shorter), each block stored group by group, and within a group field by field, chunk by chunk, its rows' B_i
    elements side by side (a chunk is one vector, a row a lane)."""
    *lead, R, G = fields[0].shape[:-2]
    parts = []
    for r0, n, nb, rows in _row_blocks(R):
        per = [f[..., r0:r0 + n, :, :, :].reshape(*lead, nb, rows, G, *f.shape[-2:]).movedim(-4, -2)
               .reshape(*lead, nb, G, -1) for f in fields]
        parts.append(torch.cat(per, -1).reshape(*lead, n, -1))
    return torch.cat(parts, -2) if len(parts) > 1 else parts[0]


def _deinterleave_rows(t: torch.Tensor, G: int, *shapes: tuple[int, int]) -> list[torch.Tensor]:
    """_interleave_rows undone: [..., R, G * sum(C_i B_i)] -> the fields [..., R, G, C_i, B_i] of shapes (C_i, B_i)."""
    *lead, R, _ = t.shape
    out: list[list[torch.Tensor]] = [[] for _ in shapes]
    for r0, n, nb, rows in _row_blocks(R):
        b = t[..., r0:r0 + n, :].reshape(*lead, nb, G, -1)
        at = 0
        for i, (C, B) in enumerate(shapes):
            f = b[..., at:at + C * rows * B].reshape(*lead, nb, G, C, rows, B).movedim(-2, -4)
            out[i].append(f.reshape(*lead, n, G, C, B))
            at += C * rows * B
    return [torch.cat(o, -4) if len(o) > 1 else o[0] for o in out]

"""Writes native/kernels/iq_grids.h: ggml's IQ1/IQ2/IQ3 grids as the gguf package holds them (gguf.quants' grid_hex), one
C++ table each (an 8-weight entry a uint64, byte j weight j; a 4-weight entry a uint32; IQ1_S's -1/0/1 as 8 v + 64, the
bytes its kernels multiply). Run it again only if ggml ever changes a grid: python tools/iq_grids.py"""
import pathlib

import numpy as np
from gguf import quants as Q

OUT = pathlib.Path(__file__).resolve().parent.parent / "native" / "kernels" / "iq_grids.h"
TABLES = (("IQ2XXS_GRID", Q.IQ2_XXS, False), ("IQ2XS_GRID", Q.IQ2_XS, False), ("IQ2S_GRID", Q.IQ2_S, False),
          ("IQ3XXS_GRID", Q.IQ3_XXS, False), ("IQ3S_GRID", Q.IQ3_S, False), ("IQ1S_GRID_BIASED", Q.IQ1_S, True))


def table(name: str, cls, biased: bool) -> list[str]:
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape).astype(np.int64)
    g = (8 * g + 64 if biased else g).astype(np.uint8)
    n, w = g.shape
    vals = g.view(np.uint64 if w == 8 else np.uint32).reshape(-1)
    per = 4 if w == 8 else 8
    rows = ["    " + ", ".join(f"0x{int(v):0{2 * w}x}" for v in vals[i:i + per]) + "," for i in range(0, n, per)]
    return [f"alignas(64) inline constexpr {'uint64_t' if w == 8 else 'uint32_t'} {name}[{n}] = {{", *rows, "};"]


def main() -> None:
    lines = ["// ggml's IQ grids (ggml-common.h's iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid, iq3s_grid, iq1s_grid) as "
             "the gguf", "// package holds them, written by tools/iq_grids.py (do not edit): an 8-weight entry a uint64 "
             "(byte j: weight j),", "// a 4-weight entry a uint32; IQ1_S's values -1, 0, 1 stored as 8 v + 64 (the bytes "
             "its kernels multiply).", "#pragma once", "", "#include <cstdint>", "", "namespace moe {", ""]
    for t in TABLES:
        lines += table(*t) + [""]
    OUT.write_text("\n".join(lines + ["}  // namespace moe", ""]))


if __name__ == "__main__":
    main()

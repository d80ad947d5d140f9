"""The built extension still holds the prefetch instructions its kernels' sources ask for.

GCC 12 deleted every _mm_prefetch of the paged decode-attention kernels (the address came through a block-table
read in the loop) without a warning; the bits stayed right and only cold-cache timings showed it (docs/performance/kernels.md,
"The paged path's prefetches were never there"). No numeric test can see that, so this one reads the binary:
objdump's disassembly of moe_kernels/_native, prefetch instructions counted per function. It does not depend on
the CPU running it (every ISA's kernels are in the binary, chosen at run time)."""
import re
import shutil
import subprocess
from collections import defaultdict

import pytest

native = pytest.importorskip("moe_kernels._native", reason="native extension not built")

# (where the source asks for prefetches, a pattern the whole demangled function name must match, anonymous namespaces and
# "moe::" removed). Every function a pattern matches must hold at least one prefetch instruction, and every
# pattern must match at least one function (a rename must update this list rather than pass unseen).
PREFETCHING = [
    ("attention.cpp: decode attention, contiguous rows", r"group_avx512<\d+, \d+, \d+, \w[\w ]*, false>"),
    ("attention.cpp: decode attention, block table (the rows GCC dropped)", r"group_avx512<\d+, \d+, \d+, \w[\w ]*, true>"),
    ("attention.cpp: decode attention avx2, contiguous rows", r"group_avx2<[\d, ]+, \w[\w ]*, false>"),
    ("attention.cpp: decode attention avx2, block table", r"group_avx2<[\d, ]+, \w[\w ]*, true>"),
    # v_prefetch_rows (V into L2 during the scores) calls these out of line rather than holding the instructions
    ("attention.cpp: paged rows' look-ahead and V into L2", r"Rows<[\w ]+, true>::prefetch_(ahead|l2)"),
    ("gemm_blocked.h: avx512 micro-kernels, full tiles with prefetch", r"mk512<\d+, \d+, true, true>"),
    ("gemm_blocked.h: avx512 tiles", r"blocked_tiles<\d+, (true|false)>"),
    ("gemm_blocked.h: avx2 drivers", r"blocked_avx2<\d+>"),
    ("gemm_blocked.h: avx-vnni drivers", r"blocked_avxvnni<\d+>"),
    ("gemm_bf16.cpp / gemm_int8.cpp: avx512 micro-kernels", r"mk512<\d+>"),
    ("gemm_bf16.cpp / gemm_int8.cpp: ymm micro-kernels", r"(mk256<|mk_avx2|mk_avxvnni|mk<\d+, true>)"),
    ("gemm_fp8.cpp: fp8 rows", r"fp8_rows"),
    ("probes.cpp: the DRAM probe", r"sum_block(_avx2)?$"),
]


def _short(name: str) -> str:
    """`void moe::(anonymous namespace)::f<1, 2>(int, ...) const` -> `f<1, 2>`; `Cls<T>::m(...)` -> `Cls<T>::m`."""
    s = name.replace("(anonymous namespace)::", "").replace("moe::", "")
    s = re.sub(r"^(void|int|float|bool|size_t|unsigned long) ", "", s)
    depth, out = 0, []
    for ch in s:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            break
        out.append(ch)
    return "".join(out)


def prefetches_per_function(path: str) -> dict:
    """{short name: [prefetch count of each copy]}; `.cold` clones (a function's unlikely branches moved out
    of line) are left out, as they hold no loop."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", path], check=True, capture_output=True,
                          text=True).stdout
    counts, current = defaultdict(list), None
    for line in text.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            current = None if "[clone .cold]" in head.group(1) else _short(head.group(1))
            if current is not None:
                counts[current].append(0)
        elif current is not None and re.search(r"\bprefetch(t0|t1|t2|nta|w)\b", line):
            counts[current][-1] += 1
    return counts


@pytest.fixture(scope="module")
def counts():
    if shutil.which("objdump") is None:
        pytest.skip("objdump (binutils) is not installed")
    return prefetches_per_function(native.__file__)


def test_the_short_names_keep_template_arguments_and_drop_the_rest():
    assert _short("void moe::(anonymous namespace)::group_avx512<2, 16, float, true>(float const*, "
                  "moe::(anonymous namespace)::Rows<float, true>, int) [clone .isra.0]") == \
        "group_avx512<2, 16, float, true>"
    assert _short("moe::(anonymous namespace)::Rows<float, true>::prefetch_l2(int, int) const") == \
        "Rows<float, true>::prefetch_l2"


@pytest.mark.parametrize("where,pattern", PREFETCHING, ids=[w for w, _ in PREFETCHING])
def test_every_prefetching_kernel_keeps_its_prefetches(counts, where, pattern):
    matched = {name: n for name, n in counts.items() if re.fullmatch(pattern, name)}
    assert matched, f"{where}: no function in the binary matches {pattern!r} (renamed? update PREFETCHING)"
    empty = sorted(name for name, n in matched.items() if min(n) == 0)
    assert not empty, (f"{where}: {len(empty)} of {len(matched)} functions hold no prefetch instruction "
                       f"(the compiler dropped them?): {empty[:5]}")


def test_the_count_sees_a_kernel_without_prefetches(counts):
    """The counter is not vacuous: the reference kernels (plain loops, no prefetch in their source) count 0."""
    refs = {name: n for name, n in counts.items() if name.startswith("ref_gemm_rows_")}
    assert refs and all(max(n) == 0 for n in refs.values())

// The (ISA, format) -> kernels table: the one place that knows which function runs what (kernels.h).
#include "kernels/kernels.h"

#include <string>

namespace moe {

namespace {

constexpr int N_ISA = 5, N_FMT = 22;  // Isa and Fmt in declaration order

// one row per ISA, one column per format (bf16, int8, int4, mxfp4, fp8, int4g32, iq4nl, uint4g32,
// int8g32, q4k, q6k, iq4xs, q5k, q3k, q2k, iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, iq1m)
constexpr GemmRowsFn GEMM[N_ISA][N_FMT] = {
    {ref_gemm_rows_bf16, ref_gemm_rows_int8, ref_gemm_rows_int4, ref_gemm_rows_mxfp4, ref_gemm_rows_fp8, ref_gemm_rows_int4g32,
     ref_gemm_rows_iq4nl, ref_gemm_rows_uint4g32, ref_gemm_rows_int8g32, ref_gemm_rows_q4k, ref_gemm_rows_q6k, ref_gemm_rows_iq4xs, ref_gemm_rows_q5k, ref_gemm_rows_q3k, ref_gemm_rows_q2k,
     ref_gemm_rows_iq2xxs, ref_gemm_rows_iq2xs, ref_gemm_rows_iq2s, ref_gemm_rows_iq3xxs, ref_gemm_rows_iq3s, ref_gemm_rows_iq1s, ref_gemm_rows_iq1m},                // portable
    {gemm_rows_bf16_avx2, gemm_rows_int8_avx2, gemm_rows_int4_avx2, gemm_rows_mxfp4_avx2, gemm_rows_fp8_avx2, gemm_rows_int4g32_avx2,
     gemm_rows_iq4nl_avx2, gemm_rows_uint4g32_avx2, gemm_rows_int8g32_avx2, gemm_rows_q4k_avx2, gemm_rows_q6k_avx2, gemm_rows_iq4xs_avx2, gemm_rows_q5k_avx2, gemm_rows_q3k_avx2, gemm_rows_q2k_avx2,
     gemm_rows_iq2xxs_avx2, gemm_rows_iq2xs_avx2, gemm_rows_iq2s_avx2, gemm_rows_iq3xxs_avx2, gemm_rows_iq3s_avx2, gemm_rows_iq1s_avx2, gemm_rows_iq1m_avx2},            // avx2
    {gemm_rows_bf16_avx2, gemm_rows_int8_avxvnni, gemm_rows_int4_avxvnni, gemm_rows_mxfp4_avxvnni, gemm_rows_fp8_avx2, gemm_rows_int4g32_avxvnni,
     gemm_rows_iq4nl_avxvnni, gemm_rows_uint4g32_avxvnni, gemm_rows_int8g32_avxvnni, gemm_rows_q4k_avxvnni, gemm_rows_q6k_avxvnni, gemm_rows_iq4xs_avxvnni, gemm_rows_q5k_avxvnni, gemm_rows_q3k_avxvnni, gemm_rows_q2k_avxvnni,
     gemm_rows_iq2xxs_avxvnni, gemm_rows_iq2xs_avxvnni, gemm_rows_iq2s_avxvnni, gemm_rows_iq3xxs_avxvnni, gemm_rows_iq3s_avxvnni, gemm_rows_iq1s_avxvnni, gemm_rows_iq1m_avxvnni},   // avxvnni
    {gemm_rows_bf16_avx512, gemm_rows_int8_avx512, gemm_rows_int4_avx512, gemm_rows_mxfp4_avx512, gemm_rows_fp8_avx512, gemm_rows_int4g32_avx512,
     gemm_rows_iq4nl_avx512, gemm_rows_uint4g32_avx512, gemm_rows_int8g32_avx512, gemm_rows_q4k_avx512, gemm_rows_q6k_avx512, gemm_rows_iq4xs_avx512, gemm_rows_q5k_avx512, gemm_rows_q3k_avx512, gemm_rows_q2k_avx512,
     gemm_rows_iq2xxs_avx512, gemm_rows_iq2xs_avx512, gemm_rows_iq2s_avx512, gemm_rows_iq3xxs_avx512, gemm_rows_iq3s_avx512, gemm_rows_iq1s_avx512, gemm_rows_iq1m_avx512},  // avx512
    {gemm_rows_bf16_avx512, gemm_rows_int8_avx512, gemm_rows_int4_amx, gemm_rows_mxfp4_amx, gemm_rows_fp8_amx, gemm_rows_int4g32_amx,
     gemm_rows_iq4nl_amx, gemm_rows_uint4g32_avx512, gemm_rows_int8g32_amx, gemm_rows_q4k_avx512, gemm_rows_q6k_amx, gemm_rows_iq4xs_amx, gemm_rows_q5k_avx512, gemm_rows_q3k_avx512, gemm_rows_q2k_avx512,
     gemm_rows_iq2xxs_avx512, gemm_rows_iq2xs_avx512, gemm_rows_iq2s_avx512, gemm_rows_iq3xxs_avx512, gemm_rows_iq3s_avx512, gemm_rows_iq1s_avx512, gemm_rows_iq1m_avx512},  // amx
};

Kernels entry(Isa isa, Fmt fmt) {
  const int i = int(isa), f = int(fmt);
  const bool ymm = ymm_path(isa), zmm = isa == Isa::Avx512 || isa == Isa::Amx;
  return Kernels{isa,
                 fmt,
                 GEMM[i][f],
                 isa == Isa::Amx && (fmt == Fmt::Bf16 || fmt == Fmt::Int8),
                 isa == Isa::Portable ? quantize_row<false> : quantize_row<true>,
                 zmm ? silu_avx512 : ymm ? silu_avx2 : silu_ref,
                 zmm ? clamped_swiglu_avx512 : ymm ? clamped_swiglu_avx2 : clamped_swiglu_ref};
}

}  // namespace

Isa usable_isa(Isa isa) {
  const CpuFeatures f = detect_cpu();
  MOE_CHECK(isa_supported(isa, f) || (isa == Isa::Amx && amx_emulation() && isa_supported(Isa::Avx512, f)),
            std::string("kernel path ") + isa_name(isa) + " not supported here");
  return isa;
}

const Kernels& kernels_for(Isa isa, Fmt fmt) {
  static const auto table = [] {
    struct Table {
      Kernels k[N_ISA][N_FMT];
    } t;
    for (int i = 0; i < N_ISA; ++i)
      for (int f = 0; f < N_FMT; ++f) t.k[i][f] = entry(Isa(i), Fmt(f));
    return t;
  }();
  MOE_CHECK(int(isa) >= 0 && int(isa) < N_ISA && int(fmt) >= 0 && int(fmt) < N_FMT, "unknown ISA or format");
  return table.k[int(usable_isa(isa))][int(fmt)];
}

void gemm_rows(const Kernels& k, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,
               size_t ldy) {
  if (k.amx_tiles && x.amx_b) {  // whole 16-row tiles on AMX; the rest on AVX-512
    const int tiles = (r1 - r0) / 16 * 16;
    if (tiles) gemm_rows_amx(k.fmt, m, e, r0, r0 + tiles, x, ns, Y, ldy);
    r0 += tiles;
    if (r0 >= r1) return;
  }
  k.gemm_rows(m, e, r0, r1, x, ns, Y, ldy);
}

}  // namespace moe

// The kernels of one (ISA, weight format) pair, resolved once into a table (kernels.cpp), as ggml's per-type
// function tables: the drivers (moe_forward.cpp, linear.cpp) call through a Kernels and never branch on the
// ISA or the format. A new ISA (NEON, AVX10) is a new file of row kernels and one row of the table.
#pragma once
#include <cstddef>
#include <type_traits>

#include "moe.h"
#include "runtime/common.h"

namespace moe {

// Y[s * ldy + r] = dequantized dot(W[e] row r, x_s) for rows [r0, r1) and every slot s < ns.
using GemmRowsFn = void (*)(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
// Row r of b = one fp32 row of n values in the format's activation form (bf16, u8 q + 128 with a scale, or
// fp32 for fp8).
using QuantizeRowFn = void (*)(Fmt fmt, const float* x, int n, ActBuf& b, int r);
// a = the experts' activation of one slot's gate and up rows (I values), each step rounded to bf16.
using ActRowFn = void (*)(const float* gate, const float* up, float* a, int I, float alpha, float limit);

struct Kernels {
  Isa isa;
  Fmt fmt;
  GemmRowsFn gemm_rows;  // every row on the vector units (on amx: the AVX-512 kernel, for what the tiles leave)
  bool amx_tiles;        // prefill's whole 16-row tiles on AMX (bf16 and int8 on the amx ISA; fp8's kernel and
                         // the row-blocked signed formats' keep their own: fp8 per block row, those per block)
  QuantizeRowFn quantize_row;
  ActRowFn silu, clamped_swiglu;
};

// isa, or std::invalid_argument when this CPU lacks it (amx: unless the tests emulate its tiles).
Isa usable_isa(Isa isa);
// The table's entry for a usable ISA (usable_isa's check).
const Kernels& kernels_for(Isa isa, Fmt fmt);

// Rows [r0, r1) on k: AMX tiles where this call's slots were packed for them (x.amx_b), the vector kernel for
// the rest.
void gemm_rows(const Kernels& k, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,
               size_t ldy);

// The row kernels the table holds, per format and ISA; ref_*: the portable loops, also the tests' reference.
void ref_gemm_rows_bf16(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_bf16_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_bf16_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_int8(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_int4(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_mxfp4(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_mxfp4_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_mxfp4_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_mxfp4_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_mxfp4_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
// Rows [r0, r1) of a bf16 matrix We (rows Kp apart) times bf16 activations X; pf: the weights' software
// prefetch distance in elements, 0 for none (weights already in cache: fp8's widened rows). AVX2: X already
// widened to fp32, per 16 elements [the even 8 | the odd 8] (the order its bf16 loads split into).
void bf16_rows_avx2(const uint16_t* We, int Kp, int r0, int r1, const uint16_t* const* X, int ns, float* Y, size_t ldy,
                    size_t pf);
void bf16_rows_avx2_widened(const uint16_t* We, int Kp, int r0, int r1, const float* const* X, int ns, float* Y,
                            size_t ldy);
void bf16_rows_avx512(const uint16_t* We, int Kp, int r0, int r1, const uint16_t* const* X, int ns, float* Y,
                      size_t ldy, size_t pf);
void ref_gemm_rows_int4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int4g32_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq4nl(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4nl_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4nl_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4nl_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4nl_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_int8g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_int8g32_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_q4k(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q4k_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q4k_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q4k_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_q5k(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q5k_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q5k_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q5k_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_q3k(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q3k_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q3k_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q3k_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_q2k(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q2k_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q2k_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q2k_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_q6k(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q6k_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q6k_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q6k_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_q6k_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq4xs(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4xs_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4xs_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4xs_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq4xs_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_uint4g32(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_uint4g32_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_uint4g32_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_uint4g32_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq2xxs(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xxs_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xxs_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xxs_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq2xs(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xs_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xs_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2xs_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq2s(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2s_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2s_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq2s_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq3xxs(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3xxs_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3xxs_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3xxs_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq3s(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3s_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3s_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq3s_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq1s(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1s_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1s_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1s_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_iq1m(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1m_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1m_avxvnni(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_iq1m_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void ref_gemm_rows_fp8(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_fp8_avx2(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_fp8_avx512(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);
void gemm_rows_fp8_amx(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy);

// The activation and quantizer entries (act_quant.cpp)
void silu_ref(const float* gate, const float* up, float* a, int I, float alpha, float limit);
void silu_avx2(const float* gate, const float* up, float* a, int I, float alpha, float limit);
void silu_avx512(const float* gate, const float* up, float* a, int I, float alpha, float limit);
void clamped_swiglu_ref(const float* gate, const float* up, float* a, int I, float alpha, float limit);
void clamped_swiglu_avx2(const float* gate, const float* up, float* a, int I, float alpha, float limit);
void clamped_swiglu_avx512(const float* gate, const float* up, float* a, int I, float alpha, float limit);
template <bool SIMD>  // SIMD: AVX2, which every ISA above portable has
void quantize_row(Fmt fmt, const float* x, int n, ActBuf& b, int r);

// The one row/token driver of the int kernels: rows in blocks of RB, slots in blocks of tb (<= TB_MAX), each
// (block, block) tile computed by tile(r, nr, s, nt, C) into C[t * RB + j] and finished into Y by
// finish(r, nr, s, nt, C).
template <int RB, int TB_MAX, class C_t, class Tile, class Finish>
inline void drive_rows(int r0, int r1, int ns, int tb, Tile&& tile, Finish&& finish) {
  for (int r = r0; r < r1; r += RB) {
    const int nr = r1 - r < RB ? r1 - r : RB;
    for (int s = 0; s < ns; s += tb) {
      const int nt = ns - s < tb ? ns - s : tb;
      C_t C[TB_MAX * RB];
      tile(r, nr, s, nt, C);
      finish(r, nr, s, nt, C);
    }
  }
}

// Calls f(std::integral_constant<int, NT>) for nt in [1, N]: the micro-kernels' token count as a template
// argument, chosen at run time.
template <int N, class F>
inline void with_tokens(int nt, F&& f) {
  if constexpr (N > 1) {
    if (nt >= N) return f(std::integral_constant<int, N>{});
    return with_tokens<N - 1>(nt, f);
  } else {
    return f(std::integral_constant<int, 1>{});
  }
}

}  // namespace moe

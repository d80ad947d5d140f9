// AMX tile kernels for prefill: bf16 (TDPBF16PS) and int8 (TDPBSUD: signed weights x unsigned
// activations, the same u8 = q + 128 convention as the VNNI kernel). The weights are the A operand,
// read in place from their row-major packing (a tile = 16 rows x 64 bytes, stride = the padded row);
// the activations of one expert are the B operand, put once per forward into the layout the tiles
// want (pack_amx_b): per group of 16 slots and per K step, 16 rows of [16 slots x 2 bf16 | 4 u8].
// Each call computes 2 x 2 tiles (32 weight rows x 32 slots) per K step from 2 A + 2 B loads.
// Rows that do not fill a 16-row tile go to the AVX-512 kernels (the callers do that).
#include <immintrin.h>
#include <cstdlib>
#include <sys/syscall.h>
#include <unistd.h>

#include "moe.h"
#include "runtime/common.h"

namespace moe {

bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  // Linux hands out the (8 KiB) tile data state only to processes that ask before the first tile
  // instruction; without it, that instruction faults.
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

size_t amx_b_bytes(Fmt fmt, int ns, int Kp) {
  const size_t groups = (ns + 15) / 16;
  return groups * size_t(Kp) * (fmt == Fmt::Bf16 ? 32 : 16);  // per group: Kp/32 (Kp/64) tiles of 1 KiB
}

// B tile layout: per group of 16 slots and per K step (32 bf16 | 64 int8), 16 rows; row j holds, for
// each slot n, its PER consecutive elements j*PER .. j*PER+PER-1 of the step. Missing slots: `pad`.
template <class T, int PER>
static void pack_b(const Acts& x, int ns, int Kp, T* d, T pad) {
  constexpr int STEP = 16 * PER;  // elements of one K step
  for (int g = 0; g < (ns + 15) / 16; ++g)
    for (int c = 0; c < Kp / STEP; ++c)
      for (int n = 0; n < 16; ++n) {
        const int s = g * 16 + n;
        const T* xs = s < ns ? static_cast<const T*>(x.rows[s]) + c * STEP : nullptr;
        T* row = d + (size_t(g) * (Kp / STEP) + c) * 16 * STEP + n * PER;
        for (int j = 0; j < 16; ++j)
          for (int p = 0; p < PER; ++p) row[j * STEP + p] = xs ? xs[j * PER + p] : pad;
      }
}

void pack_amx_b(Fmt fmt, const Acts& x, int ns, int Kp, uint8_t* dst) {
  if (fmt == Fmt::Bf16) pack_b<uint16_t, 2>(x, ns, Kp, reinterpret_cast<uint16_t*>(dst), 0);
  else pack_b<uint8_t, 4>(x, ns, Kp, dst, 128);  // u8 128 = activation 0
}

namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (16 x 16 fp32 | int32); 4, 5: A (weights); 6, 7: B (activations). Every tile is
// 16 rows x 64 bytes.
constexpr TileConfig make_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  return cfg;
}

// A constant in static storage, never a stack copy: GCC 12's _tile_loadconfig tells the compiler that
// LDTILECFG reads 8 bytes of its operand (an "m" of a pointer), so the stores that fill in the rows and
// column widths of a local config are dropped as dead, and real AMX faults (#GP) on the garbage.
constexpr TileConfig kTileConfig = make_config();
// K = 32 or 16 a product (the 32-weight groups of gemm_blocked_amx.h, q6k's 16s): A tiles (4, 5) 16 rows x K bytes,
// B tiles (6, 7) K / 4 rows x 64 bytes
constexpr TileConfig make_config_k(int k) {
  TileConfig cfg = make_config();
  cfg.colsb[4] = cfg.colsb[5] = uint16_t(k);
  cfg.rows[6] = cfg.rows[7] = uint8_t(k / 4);
  return cfg;
}
constexpr TileConfig kTileConfigK32 = make_config_k(32);
constexpr TileConfig kTileConfigK16 = make_config_k(16);

__attribute__((target("amx-tile"))) void load_config(const TileConfig* cfg = &kTileConfig) { _tile_loadconfig(cfg); }

__attribute__((target("amx-tile"))) inline void zero_c() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// C[0..3] += A(4, 5) x B(6, 7): the four products of a 2 x 2 block
template <bool BF16>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) inline void multiply_2x2() {
  if constexpr (BF16) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  } else {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
}

// The weights' 32 rows of a block_2x2 are 32 streams Kp apart, which the hardware prefetchers do not keep ahead of
// the tiles: each K step prefetches its rows' 64 bytes this many steps on (past the rows' end: the next 32 rows'
// first steps; a lone tile's rows 16-31 past the matrix are harmless, a prefetch never faults).
static const int kAmxPfSteps = [] {
  const char* v = std::getenv("MOE_AMX_PF_STEPS");
  return v ? std::atoi(v) : 8;
}();

// C[0..3] (each 16 x 16, row = weight row, column = slot) for rows A0 / A1 = A0 + 16 rows and slot groups B0 / B1.
template <bool BF16>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) void block_2x2(const uint8_t* A0, const uint8_t* A1,
                                                                       size_t lda, const uint8_t* B0,
                                                                       const uint8_t* B1, int steps, void* C) {
  zero_c();
  const int pf = kAmxPfSteps;
  for (int c = 0; c < steps; ++c) {
    if (pf) {
      const int ahead = c + pf;
      const uint8_t* p = ahead < steps ? A0 + size_t(ahead) * 64 : A0 + 32 * lda + size_t(ahead - steps) * 64;
      for (int i = 0; i < 32; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + i * lda), _MM_HINT_T0);
    }
    _tile_loadd(4, A0 + size_t(c) * 64, lda);
    _tile_loadd(5, A1 + size_t(c) * 64, lda);
    _tile_loadd(6, B0 + size_t(c) * 1024, 64);
    _tile_loadd(7, B1 + size_t(c) * 1024, 64);
    multiply_2x2<BF16>();
  }
  auto* out = static_cast<uint8_t*>(C);
  _tile_stored(0, out, 64);
  _tile_stored(1, out + 1024, 64);
  _tile_stored(2, out + 2048, 64);
  _tile_stored(3, out + 3072, 64);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// The same 2 x 2 block in plain C++, following the instructions' definitions: lets machines without
// AMX test everything around the tiles (the packing, the blocking, the edges, the epilogue).
template <bool BF16>
void block_2x2_emulated(const uint8_t* A0, const uint8_t* A1, size_t lda, const uint8_t* B0, const uint8_t* B1,
                        int steps, void* C) {
  const uint8_t* As[2] = {A0, A1};
  const uint8_t* Bs[2] = {B0, B1};
  for (int t = 0; t < 4; ++t)
    for (int mi = 0; mi < 16; ++mi)
      for (int n = 0; n < 16; ++n) {
        float accf = 0.f;
        int32_t acci = 0;
        for (int c = 0; c < steps; ++c) {
          const uint8_t* a = As[t >> 1] + size_t(mi) * lda + size_t(c) * 64;
          const uint8_t* b = Bs[t & 1] + size_t(c) * 1024;
          for (int k = 0; k < 16; ++k) {
            if (BF16) {
              auto* a16 = reinterpret_cast<const uint16_t*>(a);
              auto* b16 = reinterpret_cast<const uint16_t*>(b + k * 64);
              accf += bf16_to_f32(a16[2 * k]) * bf16_to_f32(b16[2 * n]) +
                      bf16_to_f32(a16[2 * k + 1]) * bf16_to_f32(b16[2 * n + 1]);
            } else {
              for (int q = 0; q < 4; ++q) acci += int32_t(int8_t(a[4 * k + q])) * int32_t(b[k * 64 + 4 * n + q]);
            }
          }
        }
        if (BF16) static_cast<float*>(C)[(t * 16 + mi) * 16 + n] = accf;
        else static_cast<int32_t*>(C)[(t * 16 + mi) * 16 + n] = acci;
      }
}

// out[n] = column n of the 16 x 16 row-major fp32 (or int32: only bits move) block `in`: unpack
// pairs, then 4 x 4 blocks, then 128-bit lanes twice.
__attribute__((target("avx512f"))) inline void transpose16(const float* in, __m512 out[16]) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + 16 * i);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i + 0] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    out[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    out[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// One C tile (weight rows rt..rt+15 x slots s0..s0+n-1) into Y, where a slot's 16 outputs are a
// column of the tile: transposed in registers (a scalar scatter cost as much as the multiplies for
// short rows). int8: (acc - 128 * rowsum) * row scale * slot scale, as the VNNI kernel does.
__attribute__((target("avx512f"))) void store_tile(bool bf16, const float* Ct, const Matrix& m, int e, int rt,
                                                   const Acts& x, int s0, int n, float* Y, size_t ldy) {
  __m512 col[16];
  transpose16(Ct, col);
  if (bf16) {
    for (int j = 0; j < n; ++j) _mm512_storeu_ps(Y + size_t(s0 + j) * ldy + rt, col[j]);
    return;
  }
  const size_t at = size_t(e) * m.rows + rt;
  const __m512i zero_point = _mm512_slli_epi32(_mm512_loadu_si512(m.rowsum + at), 7);  // 128 * rowsum
  const __m512 sw = _mm512_loadu_ps(m.scale + at);
  for (int j = 0; j < n; ++j) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_castps_si512(col[j]), zero_point));
    _mm512_storeu_ps(Y + size_t(s0 + j) * ldy + rt, _mm512_mul_ps(_mm512_mul_ps(v, sw), _mm512_set1_ps(x.scale[s0 + j])));
  }
}

std::atomic<bool> g_emulate{false};

}  // namespace

void set_amx_emulation(bool on) { g_emulate = on; }
void amx_tiles_begin(int k_bytes) {
  load_config(k_bytes == 32 ? &kTileConfigK32 : k_bytes == 16 ? &kTileConfigK16 : &kTileConfig);
}
void amx_tiles_end() { release(); }
bool amx_emulation() { return g_emulate; }

void gemm_rows_amx(Fmt fmt, const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  MOE_CHECK((fmt == Fmt::Bf16 || fmt == Fmt::Int8) && (r1 - r0) % 16 == 0 && x.amx_b, "AMX: whole 16-row tiles of bf16/int8 only");
  const bool bf16 = fmt == Fmt::Bf16;
  const size_t elt = bf16 ? 2 : 1, lda = size_t(m.Kp) * elt;
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * lda;
  const int steps = bf16 ? m.Kp / 32 : m.Kp / 64;
  const size_t group_bytes = size_t(steps) * 1024;
  const int groups = (ns + 15) / 16;
  alignas(64) float C[4][16 * 16];  // int32 for int8
  const bool emulate = g_emulate;
  if (!emulate) load_config();
  for (int r = r0; r < r1; r += 32) {
    const uint8_t* A0 = We + size_t(r) * lda;
    const uint8_t* A1 = r + 16 < r1 ? A0 + 16 * lda : A0;  // a lone tile computes twice, stores once
    for (int g = 0; g < groups; g += 2) {
      const uint8_t* B0 = x.amx_b + size_t(g) * group_bytes;
      const uint8_t* B1 = g + 1 < groups ? B0 + group_bytes : B0;
      if (emulate) (bf16 ? block_2x2_emulated<true> : block_2x2_emulated<false>)(A0, A1, lda, B0, B1, steps, C);
      else if (bf16) block_2x2<true>(A0, A1, lda, B0, B1, steps, C);
      else block_2x2<false>(A0, A1, lda, B0, B1, steps, C);
      for (int t = 0; t < 4; ++t) {
        const int rt = r + (t >> 1) * 16, gt = g + (t & 1);
        if (rt >= r1 || gt >= groups) continue;
        store_tile(bf16, C[t], m, e, rt, x, gt * 16, std::min(16, ns - gt * 16), Y, ldy);
      }
    }
  }
  if (!emulate) release();
}

// The peak probe's loop: the kernel's four independent accumulators on operands already in tiles,
// so nothing but the tile multiplies sets the pace.
template <bool BF16>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) static float peak_loop(long iters) {
  alignas(64) static const uint8_t zeros[1024] = {};
  alignas(64) float out[256];
  load_config();
  zero_c();
  _tile_loadd(4, zeros, 64);
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  for (long i = 0; i < iters; ++i) {
    multiply_2x2<BF16>();
  }
  _tile_stored(0, out, 64);
  release();
  return out[0];
}

float amx_peak_loop(bool bf16, long iters) { return bf16 ? peak_loop<true>(iters) : peak_loop<false>(iters); }

}  // namespace moe

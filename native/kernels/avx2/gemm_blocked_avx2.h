// The row-blocked int formats (kernels/gemm_blocked.h) on the 256-bit paths: one micro-kernel for AVX2 and
// AVX-VNNI, their dot products apart (ymm.h: Avx2Dot, VnniDot), each entry its own target (MOE_YMM_ENTRY).
#pragma once

#include "kernels/avx2/ymm.h"
#include "kernels/gemm_blocked.h"

namespace moe {

namespace {

// ---- 256-bit (AVX2, AVX-VNNI): a unit is half a block, 8 rows (its lanes of each chunk vector) ----
template <class Dot>
constexpr bool is_vnni = std::is_same_v<Dot, VnniDot>;
template <class Dot, int MODE>
constexpr bool signed_w = !is_vnni<Dot> && (MODE == IQ || MODE == IQXS || MODE == Q8);  // AVX2: the sign trick
template <class Dot, int MODE>
constexpr bool mx_small = !is_vnni<Dot> && MODE == MX;  // AVX2: mxfp4's values + 12, as nibbles are
template <class Dot, int MODE>
constexpr int excess256 = mx_small<Dot, MODE> ? MX4_SMALL : excess<MODE, signed_w<Dot, MODE>>;
// chunks of int16 pairs summed before a widening: nibbles (<= 15) 8 (8 x 2 x 15 x 128 fits int16), mxfp4's values
// + 12 (<= 24) and q5k's 5 bits (<= 31: 4 x 2 x 31 x 128 < 2^15) 4
template <int MODE>
constexpr int int16_run = MODE == MX || MODE == Q5K ? 4 : 8;

// (void functions with out-parameters: these templates have no target of their own, and the entry's flatten
// inlines them)
template <class Dot, int MODE>
inline void decode256(__m256i& q, __m256i lut) {
  if constexpr (looked_up(MODE)) q = Ymm::lookup(lut, q);
  else if constexpr (MODE == Q8 && !signed_w<Dot, MODE>) q = Ymm::xor80(q);
}
// 32 weights' dot product per lane, added to d: u[c] (weights) with chunk c of the activations broadcast
template <class Dot, int MODE>
inline void group_dot(const __m256i (&u)[8], const int32_t* xg, __m256i& d) {
  if constexpr (is_vnni<Dot>) {
    __m256i d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d = Dot::dot(d, u[c], Ymm::set1_epi32(xg[c]));
      d1 = Dot::dot(d1, u[c + 4], Ymm::set1_epi32(xg[c + 4]));
    }
    d = Ymm::add_epi32(d, d1);
  } else if constexpr (signed_w<Dot, MODE>) {  // Avx2Dot::dot(acc, q, w): q the activations, w signed weights
    __m256i d1 = Ymm::zero_si();
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d = Dot::dot(d, Ymm::set1_epi32(xg[c]), u[c]);
      d1 = Dot::dot(d1, Ymm::set1_epi32(xg[c + 4]), u[c + 4]);
    }
    d = Ymm::add_epi32(d, d1);
  } else {  // u8 weights x s8 activations in int16 pairs, int16_run chunks summed before a widening
    constexpr int run = int16_run<MODE>;
    MOE_UNROLL for (int c0 = 0; c0 < 8; c0 += run) {
      __m256i p = Dot::pairs(u[c0], Ymm::set1_epi32(xg[c0]));
      MOE_UNROLL for (int c = c0 + 1; c < c0 + run; ++c)
        p = Ymm::chain(Ymm::add_epi16(p, Dot::pairs(u[c], Ymm::set1_epi32(xg[c]))));
      d = Ymm::add_epi32(d, Dot::widen(p));
    }
  }
}
// q6k, q3k, q2k: a 32's two 16s' dot products apart, d0 (chunks 0-3) and d1 (4-7); on vpmaddubsw a run of chunks'
// int16 pairs summed before a widening: q6k's 2 (2 x 2 x 63 x 128 fits int16), q3k's and q2k's 4 (4 x 2 x 7 x 128)
template <class Dot, int MODE>
inline void sub16_dots(const __m256i (&u)[8], const int32_t* xg, __m256i& d0, __m256i& d1) {
  if constexpr (is_vnni<Dot>) {
    MOE_UNROLL for (int c = 0; c < 4; ++c) {
      d0 = Dot::dot(d0, u[c], Ymm::set1_epi32(xg[c]));
      d1 = Dot::dot(d1, u[c + 4], Ymm::set1_epi32(xg[c + 4]));
    }
  } else {
    constexpr int run = MODE == Q6K ? 2 : 4;
    MOE_UNROLL for (int c0 = 0; c0 < 4; c0 += run) {
      __m256i p0 = Dot::pairs(u[c0], Ymm::set1_epi32(xg[c0])), p1 = Dot::pairs(u[c0 + 4], Ymm::set1_epi32(xg[c0 + 4]));
      MOE_UNROLL for (int c = c0 + 1; c < c0 + run; ++c) {
        p0 = Ymm::add_epi16(p0, Dot::pairs(u[c], Ymm::set1_epi32(xg[c])));
        p1 = Ymm::add_epi16(p1, Dot::pairs(u[c + 4], Ymm::set1_epi32(xg[c + 4])));
      }
      d0 = Ymm::add_epi32(d0, Dot::widen(p0)), d1 = Ymm::add_epi32(d1, Dot::widen(p1));
    }
  }
}
// the nibble formats on vpmaddubsw with plain scales (int4, int4g32, uint4g32, mxfp4): mk256_pair's decode, and
// mk256's token tiles chunk by chunk (tokens_dot)
template <class Dot, int MODE>
constexpr bool paired256 = !is_vnni<Dot> && !signed_w<Dot, MODE> && nibble<MODE> && !k_mins(MODE) && !sub16(MODE);
// A layout group's dot products for NT tokens at once, d[t] += (its 8 rows' 32 weights) . (token t's 32), for the
// paired256 formats: each chunk vector loaded, split and decoded once and used by every token before the next (the
// token loop inside the chunk loop), so a tile holds one vector's weights, not all 8 chunks', and each token's int16
// sum is a chain (Ymm::chain): group_dot's order spilled (4 tokens' sums beside 8 chunk vectors: more than the 16
// registers). The same int16 runs and int32 sums as group_dot's (chunks c0 .. c0 + run - 1 summed before a
// widening): d bit for bit.
template <class Dot, int NT, int MODE, bool FULL>
inline void tokens_dot(const uint8_t* p, int vs, int m, size_t pf, __m256i lut, const int8_t* const* X, int lg,
                       __m256i (&d)[NT]) {
  constexpr int run = int16_run<MODE>;
  if constexpr (FULL)
    MOE_UNROLL for (int v = 0; v < 4; ++v) _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
  if constexpr (run == 8) {  // a vector's low nibbles (chunk v) and high ones (v + 4) in one int16 run
    __m256i s[NT];
    MOE_UNROLL for (int v = 0; v < 4; ++v) {
      __m256i lo, hi;
      Ymm::split_nibbles(FULL ? Ymm::load(p + 64 * v) : Ymm::load_first_epi32(p + vs * v, m), lo, hi);
      decode256<Dot, MODE>(lo, lut), decode256<Dot, MODE>(hi, lut);
      MOE_UNROLL for (int t = 0; t < NT; ++t) {
        const int32_t* xg = reinterpret_cast<const int32_t*>(X[t] + lg * G);
        const __m256i ql = Dot::pairs(lo, Ymm::set1_epi32(xg[v])), qh = Dot::pairs(hi, Ymm::set1_epi32(xg[v + 4]));
        s[t] = Ymm::chain(v ? Ymm::add_epi16(Ymm::add_epi16(s[t], ql), qh) : Ymm::add_epi16(ql, qh));
      }
    }
    MOE_UNROLL for (int t = 0; t < NT; ++t) d[t] = Ymm::add_epi32(d[t], Dot::widen(s[t]));
  } else {  // run 4 (mxfp4's values + 12): the low nibbles' run, then the high ones'
    MOE_UNROLL for (int half = 0; half < 2; ++half) {
      __m256i s[NT];
      MOE_UNROLL for (int v = 0; v < 4; ++v) {
        __m256i lo, hi;
        Ymm::split_nibbles(FULL ? Ymm::load(p + 64 * v) : Ymm::load_first_epi32(p + vs * v, m), lo, hi);
        __m256i u = half ? hi : lo;
        decode256<Dot, MODE>(u, lut);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          const int32_t* xg = reinterpret_cast<const int32_t*>(X[t] + lg * G);
          const __m256i q = Dot::pairs(u, Ymm::set1_epi32(xg[v + 4 * half]));
          s[t] = Ymm::chain(v ? Ymm::add_epi16(s[t], q) : q);
        }
      }
      MOE_UNROLL for (int t = 0; t < NT; ++t) d[t] = Ymm::add_epi32(d[t], Dot::widen(s[t]));
    }
  }
}
template <class Dot, int MODE, bool FULL>
inline void scales256(const ScaleT<MODE>* p, int m, __m256& s) {  // a half block's m scales of one group
  if constexpr (MODE == MX) {
    s = Ymm::mx_scales8(p, FULL ? 8 : m);
  } else if constexpr (fielded(MODE)) {  // read field by field instead
    s = Ymm::zero_ps();
  } else {
    s = FULL ? Ymm::loadu_ps(p) : Ymm::loadu_first_ps(p, m);
  }
}
template <class Dot, int NT, int MODE, bool FULL>
inline void mk256(const uint8_t* W, const ScaleT<MODE>* Sb, int lane0, size_t moff, int n, int m,
                  const int8_t* const* X, const int32_t* const* XC, const float* const* XS, int ng, size_t pf, float* C) {
  const ScaleT<MODE>* S = Sb + lane0;  // the half's scales (q4k: its fields at their own offsets from Sb)
  const int vs = FULL ? 64 : 4 * n, gs = stride_vectors<MODE> * vs;
  const __m256i lut = signed_w<Dot, MODE> ? Ymm::bytes16(lut_s8<MODE>())
                      : mx_small<Dot, MODE> ? Ymm::bytes16(MX4_U12)
                                            : Ymm::bytes16(reinterpret_cast<const int8_t*>(lut_u8<MODE>()));
  __m256 acc[NT];
  MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::zero_ps();
  for (int g = 0; g < ng; ++g) {
    __m256i d[NT];
    MOE_UNROLL for (int t = 0; t < NT; ++t) d[t] = Ymm::zero_si();
    __m256 qs[NT], qm[NT];  // q4k, q5k: as mk512's
    if constexpr (k_mins(MODE))
      MOE_UNROLL for (int t = 0; t < NT; ++t) qs[t] = qm[t] = Ymm::zero_ps();
    __m256i qi[NT], qn[NT];  // q6k, q3k, q2k, iq4xs: as mk512's
    if constexpr (int_scaled<MODE>)
      MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = qn[t] = Ymm::zero_si();
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;
      __m256i u[8];
      const uint8_t* p = W + size_t(lg) * gs;
      if constexpr (paired256<Dot, MODE>) {
        tokens_dot<Dot, NT, MODE, FULL>(p, vs, m, pf, lut, X, lg, d);
        continue;
      } else if constexpr (MODE == Q3K || MODE == Q2K) {  // as mk512's
        __m256i lv[3];
        MOE_UNROLL for (int k = 0; k < stride_vectors<MODE>; ++k) {
          if constexpr (FULL) {
            _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * k), _MM_HINT_T1);
            lv[k] = Ymm::load(p + 64 * k);
          } else {
            lv[k] = Ymm::load_first_epi32(p + vs * k, m);
          }
        }
        MOE_UNROLL for (int c = 0; c < 8; ++c) {
          if constexpr (MODE == Q2K) u[c] = Ymm::q2_value(lv[c / 4], c);
          else u[c] = Ymm::q3_value(lv[c / 4], lv[2], c);
        }
      } else {
        __m256i hv[2];  // q6k: the high bits of chunks 0-3, 4-7; q5k: of all 8 in hv[0]
        if constexpr (MODE == Q6K || MODE == Q5K)
          MOE_UNROLL for (int k = 0; k < stride_vectors<MODE> - 4; ++k) {
            if constexpr (FULL) {
              _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * (4 + k)), _MM_HINT_T1);
              hv[k] = Ymm::load(p + 64 * (4 + k));
            } else {
              hv[k] = Ymm::load_first_epi32(p + vs * (4 + k), m);
            }
          }
        MOE_UNROLL for (int v = 0; v < vectors<MODE>; ++v) {
          __m256i q;
          if constexpr (FULL) {
            _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
            q = Ymm::load(p + 64 * v);
          } else {
            q = Ymm::load_first_epi32(p + vs * v, m);
          }
          if constexpr (MODE == Q6K) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            u[v] = Ymm::q6_value(u[v], hv[0], v), u[v + 4] = Ymm::q6_value(u[v + 4], hv[1], v);
          } else if constexpr (MODE == Q5K) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            u[v] = Ymm::q5_value(u[v], hv[0], v), u[v + 4] = Ymm::q5_value(u[v + 4], hv[0], v + 4);
          } else if constexpr (nibble<MODE>) {
            Ymm::split_nibbles(q, u[v], u[v + 4]);
            decode256<Dot, MODE>(u[v], lut), decode256<Dot, MODE>(u[v + 4], lut);
          } else {
            u[v] = q;
            decode256<Dot, MODE>(u[v], lut);
          }
        }
      }
      if constexpr (sub16(MODE)) {  // as mk512's
        const uint8_t* sc = Sb + size_t(g) * n * SGE<MODE> + sc_at<MODE> * n + 2 * h * n;
        if constexpr (paired16(MODE)) {  // as mk512's, on vpmaddwd
          __m256i scp, mp;
          if constexpr (MODE == Q2K) Ymm::q2_scales(sc + 2 * lane0, m, scp, mp);
          else scp = mp = Ymm::s8_pairs(sc + lane0, sc + n + lane0, m);
          MOE_UNROLL for (int t = 0; t < NT; ++t) {
            __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
            sub16_dots<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d0, d1);
            const int32_t* xc = XC[t] + 2 * lg;
            qi[t] = Ymm::add_epi32(qi[t], Ymm::madd_epi16(Ymm::pair16(d0, d1), scp));
            qn[t] = Ymm::add_epi32(qn[t], Ymm::madd_epi16(mp, Ymm::set1_epi32(pair_of(xc[0], xc[1]))));
          }
          continue;
        }
        const __m256i sc0 = Ymm::s8_to_epi32(sc + lane0, m), sc1 = Ymm::s8_to_epi32(sc + n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          __m256i d0 = Ymm::zero_si(), d1 = Ymm::zero_si();
          sub16_dots<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d0, d1);
          const int32_t* xc = XC[t] + 2 * lg;
          d0 = Ymm::sub_epi32(d0, Ymm::set1_epi32(xc[0])), d1 = Ymm::sub_epi32(d1, Ymm::set1_epi32(xc[1]));
          qi[t] = Ymm::add_epi32(qi[t], Ymm::add_epi32(Ymm::mullo_epi32(d0, sc0), Ymm::mullo_epi32(d1, sc1)));
        }
        continue;
      }
      MOE_UNROLL for (int t = 0; t < NT; ++t)
        group_dot<Dot, MODE>(u, reinterpret_cast<const int32_t*>(X[t] + lg * G), d[t]);
      if constexpr (MODE == IQXS) {  // as mk512's
        const __m256i sc = Ymm::s8_to_epi32(Sb + size_t(g) * n * SGE<MODE> + 4 * n + h * n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          qi[t] = Ymm::add_epi32(qi[t], Ymm::mullo_epi32(Ymm::sub_epi32(d[t], Ymm::set1_epi32(XC[t][lg])), sc));
          d[t] = Ymm::zero_si();
        }
        continue;
      }
      if constexpr (k_mins(MODE)) {
        const uint8_t* sg = Sb + size_t(g) * n * 24;
        const __m256 sc = Ymm::u8_to_ps(sg + 8 * n + h * n + lane0, m), mn = Ymm::u8_to_ps(sg + 16 * n + h * n + lane0, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) {
          qs[t] = Ymm::fmadd(Ymm::to_ps(d[t]), sc, qs[t]);
          qm[t] = Ymm::fmadd(mn, Ymm::set1(XS[t][lg]), qm[t]);
          d[t] = Ymm::zero_si();
        }
      }
    }
    if constexpr (int_scaled<MODE>) {
      const float* dp = reinterpret_cast<const float*>(Sb + size_t(g) * n * SGE<MODE>) + lane0;
      const __m256 dv = FULL ? Ymm::loadu_ps(dp) : Ymm::loadu_first_ps(dp, m);
      if constexpr (MODE == Q3K)
        MOE_UNROLL for (int t = 0; t < NT; ++t) qi[t] = Ymm::sub_epi32(qi[t], qn[t]);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fmadd(Ymm::to_ps(qi[t]), dv, acc[t]);
      if constexpr (MODE == Q2K) {
        const float* dminp = reinterpret_cast<const float*>(Sb + size_t(g) * n * SGE<MODE> + 4 * n) + lane0;
        const __m256 dminv = FULL ? Ymm::loadu_ps(dminp) : Ymm::loadu_first_ps(dminp, m);
        MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fnmadd(Ymm::to_ps(qn[t]), dminv, acc[t]);
      }
      continue;
    }
    if constexpr (k_mins(MODE)) {
      const uint8_t* sg = Sb + size_t(g) * n * 24;
      const float* dp = reinterpret_cast<const float*>(sg) + lane0;
      const float* dminp = reinterpret_cast<const float*>(sg + 4 * n) + lane0;
      const __m256 dv = FULL ? Ymm::loadu_ps(dp) : Ymm::loadu_first_ps(dp, m);
      const __m256 dminv = FULL ? Ymm::loadu_ps(dminp) : Ymm::loadu_first_ps(dminp, m);
      MOE_UNROLL for (int t = 0; t < NT; ++t) acc[t] = Ymm::fnmadd(qm[t], dminv, Ymm::fmadd(qs[t], dv, acc[t]));
      continue;
    }
    __m256 sv, mv;
    scales256<Dot, MODE, FULL>(S + size_t(g) * n, m, sv);
    if constexpr (MODE == ASYM)
      mv = FULL ? Ymm::loadu_ps(S + moff + size_t(g) * n) : Ymm::loadu_first_ps(S + moff + size_t(g) * n, m);
    MOE_UNROLL for (int t = 0; t < NT; ++t) {
      if constexpr (excess256<Dot, MODE> != 0) d[t] = Ymm::sub_epi32(d[t], Ymm::set1_epi32(XC[t][g]));
      acc[t] = Ymm::fmadd(Ymm::to_ps(d[t]), sv, acc[t]);
      if constexpr (MODE == ASYM) acc[t] = Ymm::fnmadd(mv, Ymm::set1(XS[t][g]), acc[t]);
    }
  }
  MOE_UNROLL for (int t = 0; t < NT; ++t) Ymm::storeu_ps(C + t * 8, acc[t]);
}

inline bool pair_off() {  // MOE_AVX2_PAIR=0: two mk256 calls instead of mk256_pair (A/B runs)
  static const bool off = [] {
    const char* v = std::getenv("MOE_AVX2_PAIR");
    return v && v[0] == '0';
  }();
  return off;
}
// AVX2 decode (one token) of a whole block's two halves at once, for the nibble formats on vpmaddubsw (int4,
// int4g32, uint4g32, mxfp4): each broadcast activation chunk serves both halves' 8 rows, half the broadcasts
// of two mk256 calls (on a Zen 1 the 256-bit path is instruction-bound, docs/performance/kernels.md). The same integer sums
// as mk256's (reordered, exact), the same float steps: bit for bit its result. C [16].
template <class Dot, int MODE>
inline void mk256_pair(const uint8_t* W, const ScaleT<MODE>* S, size_t moff, const int8_t* X, const int32_t* XC,
                       const float* XS, int ng, size_t pf, float* C) {
  constexpr int n = BLK, gs = 4 * 64;  // a full block: 4 chunk vectors of 64 bytes a layout group
  const __m256i lut = Ymm::bytes16(mx_small<Dot, MODE> ? MX4_U12 : reinterpret_cast<const int8_t*>(lut_u8<MODE>()));
  __m256 acc[2] = {Ymm::zero_ps(), Ymm::zero_ps()};
  for (int g = 0; g < ng; ++g) {
    __m256i d[2] = {Ymm::zero_si(), Ymm::zero_si()};
    MOE_UNROLL for (int h = 0; h < SPG<MODE>; ++h) {
      const int lg = g * SPG<MODE> + h;
      const uint8_t* p = W + size_t(lg) * gs;
      const int32_t* xg = reinterpret_cast<const int32_t*>(X + lg * G);
      __m256i plo[2], phi[2];  // per half: chunks 0-3 (low nibbles), 4-7 (high), int16 pairs
      MOE_UNROLL for (int v = 0; v < 4; ++v) {
        _mm_prefetch(reinterpret_cast<const char*>(p + pf + 64 * v), _MM_HINT_T1);
        const __m256i xl = Ymm::set1_epi32(xg[v]), xh = Ymm::set1_epi32(xg[v + 4]);
        MOE_UNROLL for (int b = 0; b < 2; ++b) {
          __m256i lo, hi;
          Ymm::split_nibbles(Ymm::load(p + 64 * v + 32 * b), lo, hi);
          decode256<Dot, MODE>(lo, lut), decode256<Dot, MODE>(hi, lut);
          const __m256i ql = Dot::pairs(lo, xl), qh = Dot::pairs(hi, xh);
          plo[b] = v ? Ymm::add_epi16(plo[b], ql) : ql;
          phi[b] = v ? Ymm::add_epi16(phi[b], qh) : qh;
        }
      }
      MOE_UNROLL for (int b = 0; b < 2; ++b) {
        if constexpr (int16_run<MODE> == 4)
          d[b] = Ymm::add_epi32(d[b], Ymm::add_epi32(Dot::widen(plo[b]), Dot::widen(phi[b])));
        else  // all 8 in int16
          d[b] = Ymm::add_epi32(d[b], Dot::widen(Ymm::add_epi16(plo[b], phi[b])));
      }
    }
    MOE_UNROLL for (int b = 0; b < 2; ++b) {
      __m256 sv;
      scales256<Dot, MODE, true>(S + size_t(g) * n + 8 * b, 8, sv);
      if constexpr (excess256<Dot, MODE> != 0) d[b] = Ymm::sub_epi32(d[b], Ymm::set1_epi32(XC[g]));
      acc[b] = Ymm::fmadd(Ymm::to_ps(d[b]), sv, acc[b]);
      if constexpr (MODE == ASYM) acc[b] = Ymm::fnmadd(Ymm::loadu_ps(S + moff + size_t(g) * n + 8 * b), Ymm::set1(XS[g]), acc[b]);
    }
  }
  Ymm::storeu_ps(C, acc[0]);
  Ymm::storeu_ps(C + 8, acc[1]);
}

// the 256-bit paths: a block's halves (lanes 0-7, 8-15) in turn, each its 8 rows' column of C
template <class Dot, int MODE>
inline int units256(const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,
                    const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C) {
  if constexpr (paired256<Dot, MODE>) {
    if (n == BLK && nt == 1 && !pair_off()) {
      mk256_pair<Dot, MODE>(wb, sb, moff, X[0], XC[0], XS[0], ng, pf, C);
      return 2;
    }
  }
  const int halves = (n + 7) / 8;
  for (int h = 0; h < halves; ++h) {
    const int m = std::min(8, n - 8 * h);
    float Ch[4 * 8];
    with_tokens<4>(nt, [&](auto NT) {
      if (n == BLK)
        mk256<Dot, decltype(NT)::value, MODE, true>(wb + 32 * h, sb, 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
      else
        mk256<Dot, decltype(NT)::value, MODE, false>(wb + 32 * h, sb, 8 * h, moff, n, m, X, XC, XS, ng, pf, Ch);
    });
    for (int t = 0; t < nt; ++t)
      for (int j = 0; j < 8; ++j) C[(t * halves + h) * 8 + j] = Ch[t * 8 + j];
  }
  return halves;
}

#define MOE_BLOCKED_YMM(NAME, TARGET, DOT)                                                                          \
  template <int MODE>                                                                                               \
  MOE_YMM_ENTRY(TARGET) void NAME(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y,         \
                                  size_t ldy) {                                                                     \
    drive_blocked<MODE, excess256<DOT, MODE>, 8, 4>(                                                                 \
        m, e, r0, r1, x, ns, Y, ldy,                                                                                \
        [&](const uint8_t* wb, const ScaleT<MODE>* sb, size_t moff, int n, const int8_t* const* X,                 \
            const int32_t* const* XC, const float* const* XS, int ng, size_t pf, int nt, float* C, size_t,         \
            size_t) {                                                                                               \
          return units256<DOT, MODE>(wb, sb, moff, n, X, XC, XS, ng, pf, nt, C);                                   \
        });                                                                                                         \
  }
MOE_BLOCKED_YMM(blocked_avx2, "avx2,fma", Avx2Dot)
MOE_BLOCKED_YMM(blocked_avxvnni, "avx2,fma,avxvnni", VnniDot)
#undef MOE_BLOCKED_YMM

}  // namespace

}  // namespace moe

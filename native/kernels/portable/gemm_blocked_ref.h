// The row-blocked int formats (kernels/gemm_blocked.h) in portable C++: the portable path and the tests'
// reference.
#pragma once

#include "kernels/gemm_blocked.h"

namespace moe {

namespace {

// The reference: each weight read from the layout one at a time, the same sums in the same numbers.
template <int MODE>
void ref_blocked(const Matrix& m, int e, int r0, int r1, const Acts& x, int ns, float* Y, size_t ldy) {
  const int ng = m.Kp / (G * SPG<MODE>), nlg = m.Kp / G;
  const size_t ldw = row_bytes<MODE>(m.Kp);
  const uint8_t* We = static_cast<const uint8_t*>(m.w) + size_t(e) * m.rows * ldw;
  const size_t moff = MODE == ASYM ? size_t(m.rows) * ng : 0;
  const ScaleT<MODE>* Se =
      reinterpret_cast<const ScaleT<MODE>*>(m.scale) + size_t(e) * (size_t(m.rows) * ng * SGE<MODE> + moff);
  auto X = reinterpret_cast<const uint8_t* const*>(x.rows);
  for (int r = r0; r < r1; ++r) {
    const int b0 = r / BLK * BLK, n = std::min(BLK, m.rows - b0), j = r - b0;
    const uint8_t* wb = We + size_t(b0) * ldw;
    const ScaleT<MODE>* sb = Se + size_t(b0) * ng * SGE<MODE>;
    for (int s = 0; s < ns; ++s) {
      float acc = 0.f, qs = 0.f, qm = 0.f;  // q4k, q5k: the 256's sums of sc x dot and m x activation sum
      int32_t dot = 0, xsum = 0, qi = 0, qn = 0, x16 = 0;  // q6k: the 256's sum of sc x dot; q2k: and of m x x16
      for (int lg = 0; lg < nlg; ++lg) {
        for (int i = 0; i < G; ++i) {
          const int c = i / 4, k = i % 4;  // chunk, byte of the lane
          int32_t w;
          if constexpr (MODE == Q8) {
            w = int8_t(wb[size_t(lg) * 32 * n + size_t(c) * 4 * n + 4 * j + k]);
          } else if constexpr (MODE == Q6K) {  // the nibble, and the high 2 bits from the 32's last two vectors
            const uint8_t* gb = wb + size_t(lg) * 24 * n;
            const uint8_t byte = gb[size_t(c % 4) * 4 * n + 4 * j + k], hb = gb[size_t(4 + c / 4) * 4 * n + 4 * j + k];
            w = ((c < 4 ? byte & 15 : byte >> 4) | (((hb >> (2 * (c % 4))) & 3) << 4)) - 32;
          } else if constexpr (MODE == Q3K) {  // the low bit pair from vector c / 4, the high bit from the last
            const uint8_t* gb = wb + size_t(lg) * 12 * n;
            const uint8_t lb = gb[size_t(c / 4) * 4 * n + 4 * j + k], hb = gb[size_t(2) * 4 * n + 4 * j + k];
            w = (((lb >> (2 * (c % 4))) & 3) | (((hb >> c) & 1) << 2)) - 4;
          } else if constexpr (MODE == Q2K) {  // the bit pair from vector c / 4
            w = (wb[size_t(lg) * 8 * n + size_t(c / 4) * 4 * n + 4 * j + k] >> (2 * (c % 4))) & 3;
          } else if constexpr (MODE == Q5K) {  // the nibble, and the high bit from the 32's last vector
            const uint8_t* gb = wb + size_t(lg) * 20 * n;
            const uint8_t byte = gb[size_t(c % 4) * 4 * n + 4 * j + k], hb = gb[size_t(4) * 4 * n + 4 * j + k];
            w = (c < 4 ? byte & 15 : byte >> 4) | (((hb >> c) & 1) << 4);
          } else {
            const uint8_t byte = wb[size_t(lg) * 16 * n + size_t(c % 4) * 4 * n + 4 * j + k];
            const int q = c < 4 ? byte & 15 : byte >> 4;
            w = looked_up(MODE) ? lut_s8<MODE>()[q] : has_mins<MODE> ? q : q - 8;
          }
          const int32_t xv = int32_t(X[s][lg * G + i]) - 128;
          dot += w * xv;
          xsum += xv;
          x16 += xv;
          if constexpr (sub16(MODE))
            if (i % Q6_SUB == Q6_SUB - 1) {  // the 16's sc (q2k: and m)
              const size_t h = lg % SPG<MODE>, half = i / Q6_SUB;
              const uint8_t* sg = sb + size_t(lg / SPG<MODE>) * n * SGE<MODE> + sc_at<MODE> * n;
              if constexpr (MODE == Q2K) {  // a 32's byte pairs, row by row
                const uint8_t byte = sg[2 * h * n + 2 * j + half];
                qi += dot * (byte & 15);
                qn += x16 * (byte >> 4);
              } else {
                qi += dot * int8_t(sg[(2 * h + half) * n + j]);
              }
              dot = x16 = 0;
            }
        }
        const int g = lg / SPG<MODE>;
        if constexpr (MODE == IQXS) {
          qi += dot * int8_t(sb[size_t(g) * n * SGE<MODE> + 4 * n + size_t(lg % SPG<MODE>) * n + j]);
          dot = 0;
        }
        if constexpr (int_scaled<MODE>) {  // per 256: d (q2k: and dmin)
          if ((lg + 1) % SPG<MODE> == 0) {
            float d;
            std::memcpy(&d, sb + size_t(g) * n * SGE<MODE> + 4 * j, 4);
            acc = std::fma(float(qi), d, acc);
            if constexpr (MODE == Q2K) {
              float dmin;
              std::memcpy(&dmin, sb + size_t(g) * n * SGE<MODE> + 4 * n + 4 * j, 4);
              acc = std::fma(-float(qn), dmin, acc);
            }
            qi = qn = xsum = 0;
          }
        } else if constexpr (k_mins(MODE)) {  // per 32: sc and m; per 256: d and dmin
          const uint8_t* sg = sb + size_t(g) * n * 24;
          const int h = lg % SPG<MODE>;
          qs += float(dot) * float(sg[8 * n + h * n + j]);
          qm += float(sg[16 * n + h * n + j]) * float(xsum);
          dot = xsum = 0;
          if (h == SPG<MODE> - 1) {
            float d, dmin;
            std::memcpy(&d, sg + 4 * j, 4);
            std::memcpy(&dmin, sg + 4 * n + 4 * j, 4);
            acc = acc + qs * d - qm * dmin;
            qs = qm = 0.f;
          }
        } else if ((lg + 1) % SPG<MODE> == 0) {  // the end of a scale group
          acc += float(dot) * scale_of<MODE>(sb[size_t(g) * n + j]);
          if constexpr (MODE == ASYM) acc -= sb[moff + size_t(g) * n + j] * float(xsum);
          dot = xsum = 0;
        }
      }
      Y[size_t(s) * ldy + r] = acc * x.scale[s];
    }
  }
}

}  // namespace

}  // namespace moe

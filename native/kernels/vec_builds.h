// One elementwise function built for AVX-512, AVX2 and the baseline, chosen at run time. The extension is built
// for baseline x86-64 (setup.py), where bf16 conversions and roundings stay scalar; at decode these loops run a
// few thousand elements a call, a layer, a token (perf at 48 layers: docs/performance/decode_step.md). The function given
// must be always_inline and carry optimize("fp-contract=off") (GCC inlines only across equal optimize
// attributes); its loops lane-wise with nothing reassociated, so every build gives the same bits.
#pragma once

#include "moe.h"

namespace moe {

enum class Vec { Base, V256, V512 };

// this CPU's width (the OS must save the register state, which detect_cpu checks)
inline Vec vec_level() {
  const CpuFeatures& f = detect_cpu();
  return f.avx512f && f.avx512bw && f.os_avx512 ? Vec::V512 : f.avx2 && f.os_avx ? Vec::V256 : Vec::Base;
}

// a kernel path's width: MOE_KERNEL_PATH=avx2 on an AVX-512 CPU runs the loops as an AVX2-only CPU would
inline Vec vec_of(Isa isa) {
  return isa == Isa::Avx512 || isa == Isa::Amx ? Vec::V512 : ymm_path(isa) ? Vec::V256 : Vec::Base;
}

// whether this CPU runs AVX2 + FMA (torch_rounding.h's torch_expf: its fmas one instruction each)
inline bool has_fma() {
  const CpuFeatures& f = detect_cpu();
  return f.fma && f.avx2 && f.os_avx;
}

}  // namespace moe

// NAME(Vec, args...) calls FN(args...) built for that width (FN's template arguments deduced from args)
#define MOE_VEC_BUILDS(NAME, FN)                                                                                      \
  template <class... A>                                                                                               \
  __attribute__((target("avx512f,avx512bw"), optimize("fp-contract=off"))) void NAME##_512(A&&... a) {                \
    FN(static_cast<A&&>(a)...);                                                                                       \
  }                                                                                                                   \
  template <class... A>                                                                                               \
  __attribute__((target("avx2"), optimize("fp-contract=off"))) void NAME##_256(A&&... a) {                            \
    FN(static_cast<A&&>(a)...);                                                                                       \
  }                                                                                                                   \
  template <class... A>                                                                                               \
  __attribute__((optimize("fp-contract=off"))) void NAME##_base(A&&... a) {                                           \
    FN(static_cast<A&&>(a)...);                                                                                       \
  }                                                                                                                   \
  template <class... A>                                                                                               \
  void NAME(::moe::Vec v, A&&... a) {                                                                                 \
    if (v == ::moe::Vec::V512) return NAME##_512(static_cast<A&&>(a)...);                                             \
    if (v == ::moe::Vec::V256) return NAME##_256(static_cast<A&&>(a)...);                                             \
    NAME##_base(static_cast<A&&>(a)...);                                                                              \
  }

// NAME(fma, args...) calls FN(args...) built for AVX2 + FMA (fma true: std::fma one instruction, not a libm call;
// the caller checks the CPU) or the baseline; FN as above
#define MOE_FMA_BUILDS(NAME, FN)                                                                                      \
  template <class... A>                                                                                               \
  __attribute__((target("avx2,fma"), optimize("fp-contract=off"))) void NAME##_fma(A&&... a) {                        \
    FN(static_cast<A&&>(a)...);                                                                                       \
  }                                                                                                                   \
  template <class... A>                                                                                               \
  __attribute__((optimize("fp-contract=off"))) void NAME##_plain(A&&... a) {                                          \
    FN(static_cast<A&&>(a)...);                                                                                       \
  }                                                                                                                   \
  template <class... A>                                                                                               \
  void NAME(bool fma, A&&... a) {                                                                                     \
    if (fma) return NAME##_fma(static_cast<A&&>(a)...);                                                               \
    NAME##_plain(static_cast<A&&>(a)...);                                                                             \
  }

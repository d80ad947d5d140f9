// The MoE operator's C++ interface (buffers in, buffers out; no torch dependency).
#pragma once
#include <cstdint>
#include <string>

namespace moe {

enum class Isa { Portable, Avx512Bf16, Amx };

struct MoEShape {
  int E, I, H;
  int Ip, Hp;  // I and H padded to a multiple of 32 in the packed weights
};

struct CpuFeatures {
  bool avx512f, avx512bw, avx512bf16, avx512vnni, amx_tile, amx_bf16, os_avx512, os_amx;
};

CpuFeatures detect_cpu();
Isa best_isa(const CpuFeatures& f);
const char* isa_name(Isa isa);
bool isa_supported(Isa isa, const CpuFeatures& f);

// hidden [T, H] fp32, ids [T, k] int32, weights [T, k] fp32 -> out [T, H] fp32.
void moe_forward_bf16(Isa isa, const MoEShape& s, const uint16_t* gate_up, const uint16_t* down,
                      const float* hidden, const int32_t* ids, const float* weights, float* out, int T, int k);

}  // namespace moe

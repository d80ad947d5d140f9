#pragma once
#include <cstddef>
#include <string>

namespace moe {
// bytes/s, all pool threads; variant: auto (the widest the CPU and OS allow) | avx512 | avx2 | scalar
double read_bandwidth(const float* buf, size_t n_floats, const std::string& variant = "auto");
double bf16_peak_flops(long iters);                        // FLOP/s of vdpbf16ps, all pool threads
double vnni_peak_ops(long iters);                          // int8 OP/s of vpdpbusd, all pool threads
double fma_peak_flops(long iters);                         // FLOP/s of 256-bit fp32 FMA, all pool threads
double avx2_int8_peak_ops(long iters);                     // int8 OP/s of vpmaddubsw+vpmaddwd+vpaddd
double avxvnni_peak_ops(long iters);                       // int8 OP/s of vpdpbusd on ymm (AVX-VNNI)
double amx_bf16_peak_flops(long iters);                    // FLOP/s of TDPBF16PS, all pool threads
double amx_int8_peak_ops(long iters);                      // int8 OP/s of TDPBSUD, all pool threads
}  // namespace moe

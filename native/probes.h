#pragma once
#include <cstddef>

namespace moe {
double read_bandwidth(const float* buf, size_t n_floats);  // bytes/s, all pool threads
double bf16_peak_flops(long iters);                        // FLOP/s of vdpbf16ps, all pool threads
double vnni_peak_ops(long iters);                          // int8 OP/s of vpdpbusd, all pool threads
}  // namespace moe

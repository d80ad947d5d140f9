#pragma once
#include <cstddef>

namespace moe {
double read_bandwidth(const float* buf, size_t n_floats);  // bytes/s, all pool threads
double bf16_peak_flops(long iters);                        // FLOP/s of vdpbf16ps, all pool threads
}  // namespace moe

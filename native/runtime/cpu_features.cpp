// Run-time ISA choice: CPUID says what the core has, XGETBV says what the OS saves on context
// switch (AVX-512 state: XCR0 bits 5-7; AMX tile state: bits 17-18), and for AMX the OS must also
// grant this process the tile data state. All must agree.
#include <cpuid.h>

#include <atomic>

#include "kernels/torch_rounding.h"
#include "kernels/vec_builds.h"
#include "moe.h"

namespace moe {

static uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}

static CpuFeatures probe_cpu() {
  CpuFeatures f{};
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  bool osxsave = c & (1u << 27);
  uint64_t xcr0 = osxsave ? xgetbv0() : 0;
  f.os_avx = (xcr0 & 0x6) == 0x6;
  f.os_avx512 = (xcr0 & 0xe6) == 0xe6;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = b & (1u << 5);
  f.avx512f = b & (1u << 16);
  f.avx512bw = b & (1u << 30);
  f.avx512vbmi = c & (1u << 1);
  f.avx512vnni = c & (1u << 11);
  f.amx_bf16 = d & (1u << 22);
  f.amx_tile = d & (1u << 24);
  f.amx_int8 = d & (1u << 25);
  __cpuid_count(7, 1, a, b, c, d);
  f.avxvnni = a & (1u << 4);
  f.avx512bf16 = a & (1u << 5);
  return f;
}

// Probed once: CPUID traps to the hypervisor in a VM (microseconds each), and the kernels'
// entry points check the path on every call.
CpuFeatures detect_cpu() {
  static const CpuFeatures f = probe_cpu();
  return f;
}

namespace rounding {
namespace {
std::atomic<int> vector_bytes{-1};  // -1: not set
}
int torch_vector_bytes() {
  const int b = vector_bytes.load(std::memory_order_relaxed);
  if (b >= 0) return b;
  return vec_level() == Vec::V512 ? 64 : has_fma() ? 32 : 0;  // torch's own default choice on x86
}
void set_torch_vector_bytes(int bytes) {
  MOE_CHECK(bytes == 0 || bytes == 32 || bytes == 64, "torch's vector width: 0, 32 or 64 bytes");
  vector_bytes.store(bytes, std::memory_order_relaxed);
}
}  // namespace rounding

bool isa_supported(Isa isa, const CpuFeatures& f) {
  switch (isa) {
    case Isa::Portable: return true;
    case Isa::Avx2: return f.os_avx && f.avx2 && f.fma && f.f16c;
    case Isa::AvxVnni: return f.avxvnni && isa_supported(Isa::Avx2, f);
    case Isa::Avx512: return f.os_avx512 && f.avx512f && f.avx512bw && f.avx512bf16 && f.avx512vnni;
    case Isa::Amx:  // and the OS must grant this process the tile state (Linux: arch_prctl)
      return f.os_amx && f.amx_tile && f.amx_bf16 && f.amx_int8 && isa_supported(Isa::Avx512, f) && amx_permitted();
  }
  return false;
}

Isa best_isa(const CpuFeatures& f) {
  // AMX covers prefill of bf16/int8 weights; decode and int4 run the AVX-512 kernels on it too
  if (isa_supported(Isa::Amx, f)) return Isa::Amx;
  if (isa_supported(Isa::Avx512, f)) return Isa::Avx512;
  if (isa_supported(Isa::AvxVnni, f)) return Isa::AvxVnni;
  return isa_supported(Isa::Avx2, f) ? Isa::Avx2 : Isa::Portable;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Portable: return "portable";
    case Isa::Avx2: return "avx2";
    case Isa::AvxVnni: return "avxvnni";
    case Isa::Avx512: return "avx512";
    case Isa::Amx: return "amx";
  }
  return "?";
}

}  // namespace moe

// pybind11 bindings: raw pointers + shapes in (the Python layer owns the tensors), GIL released.
#include <pybind11/pybind11.h>

#include "common.h"
#include "huge_buffer.h"
#include "moe.h"
#include "probes.h"

namespace py = pybind11;
using namespace moe;

static Isa parse_isa(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx512") return Isa::Avx512;
  if (name == "amx") return Isa::Amx;
  throw std::invalid_argument("unknown kernel path '" + name + "' (portable, avx512, amx)");
}

PYBIND11_MODULE(_moe_native, m) {
  m.doc() = "Native routed-expert kernels (see native/)";
  py::class_<HugeBuffer>(m, "HugeBuffer", py::buffer_protocol(),
                         "bytes on 2 MiB-aligned memory advised for transparent huge pages")
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("nbytes", &HugeBuffer::size)
      .def_buffer([](HugeBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {b.size()}, {1});
      });
  m.def("cpu_features", [] {
    CpuFeatures f = detect_cpu();
    py::dict d;
    d["avx512f"] = f.avx512f; d["avx512bw"] = f.avx512bw; d["avx512bf16"] = f.avx512bf16;
    d["avx512vnni"] = f.avx512vnni; d["amx_tile"] = f.amx_tile; d["amx_bf16"] = f.amx_bf16; d["amx_int8"] = f.amx_int8;
    d["os_avx512"] = f.os_avx512; d["os_amx"] = f.os_amx;
    return d;
  });
  m.def("best_path", [] { return std::string(isa_name(best_isa(detect_cpu()))); });
  m.def("path_supported", [](const std::string& p) { return isa_supported(parse_isa(p), detect_cpu()); });
  m.def("read_bandwidth", [](uintptr_t buf, size_t n) {
    py::gil_scoped_release nogil;
    return read_bandwidth(reinterpret_cast<const float*>(buf), n);
  });
  m.def("bf16_peak_flops", [](long iters) {
    MOE_CHECK(isa_supported(Isa::Avx512, detect_cpu()), "no AVX-512 BF16 on this CPU");
    py::gil_scoped_release nogil;
    return bf16_peak_flops(iters);
  });
  m.def("vnni_peak_ops", [](long iters) {
    MOE_CHECK(isa_supported(Isa::Avx512, detect_cpu()), "no AVX-512 VNNI on this CPU");
    py::gil_scoped_release nogil;
    return vnni_peak_ops(iters);
  });
  m.def("init_pool", [](int threads) { return pool(threads).size(); }, py::arg("threads"),
        "create the shared pool on first use (later calls return its size)");
  m.def("set_threads", [](int threads) { py::gil_scoped_release nogil; return resize_pool(threads); },
        py::arg("threads"), "rebuild the shared pool with this many threads (no work may be in flight)");
  m.def(
      "forward",
      [](const std::string& path, const std::string& fmt, int E, int I, int H, int Kp_h, int Kp_i, uintptr_t gu_w,
         uintptr_t gu_scale, uintptr_t gu_rowsum, uintptr_t gu_rowcorr, uintptr_t dn_w, uintptr_t dn_scale,
         uintptr_t dn_rowsum, uintptr_t dn_rowcorr,
         uintptr_t hidden, uintptr_t ids, uintptr_t weights, uintptr_t out, int T, int k) {
        Isa isa = parse_isa(path);
        MOE_CHECK(isa_supported(isa, detect_cpu()), std::string("kernel path ") + path + " not supported here");
        MOE_CHECK(isa != Isa::Amx, "no AMX tile kernels are built yet");
        Fmt f = fmt == "bf16" ? Fmt::Bf16 : fmt == "int8" ? Fmt::Int8 : fmt == "int4" ? Fmt::Int4
              : throw std::invalid_argument("unknown weight format '" + fmt + "' (bf16, int8, int4)");
        MoEWeights m{f, E, H, I,
                     Matrix{reinterpret_cast<const void*>(gu_w), reinterpret_cast<const float*>(gu_scale),
                            reinterpret_cast<const int32_t*>(gu_rowsum), reinterpret_cast<const float*>(gu_rowcorr), 2 * I, H,
                            Kp_h},
                     Matrix{reinterpret_cast<const void*>(dn_w), reinterpret_cast<const float*>(dn_scale),
                            reinterpret_cast<const int32_t*>(dn_rowsum), reinterpret_cast<const float*>(dn_rowcorr), H, I,
                            Kp_i}};
        py::gil_scoped_release nogil;
        moe_forward(isa, m, reinterpret_cast<const float*>(hidden), reinterpret_cast<const int32_t*>(ids),
                    reinterpret_cast<const float*>(weights), reinterpret_cast<float*>(out), T, k);
      },
      py::arg("path"), py::arg("fmt"), py::arg("E"), py::arg("I"), py::arg("H"), py::arg("Kp_h"), py::arg("Kp_i"),
      py::arg("gu_w"), py::arg("gu_scale"), py::arg("gu_rowsum"), py::arg("gu_rowcorr"), py::arg("dn_w"),
      py::arg("dn_scale"), py::arg("dn_rowsum"), py::arg("dn_rowcorr"), py::arg("hidden"), py::arg("ids"), py::arg("weights"), py::arg("out"), py::arg("T"),
      py::arg("k"));
}

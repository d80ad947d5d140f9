// The runtime's bindings: the CPU's features and kernel paths, the streaming knobs, the machine probes, NUMA, the
// thread pool and its scratch, the waits' contention policy (native/runtime/).
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>

#include "bindings/bindings.h"
#include "kernels/torch_rounding.h"
#include "moe.h"
#include "runtime/common.h"
#include "runtime/contention.h"
#include "runtime/huge_buffer.h"
#include "runtime/numa.h"
#include "runtime/probes.h"

namespace moe {

void bind_runtime(py::module_& m) {
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
    d["avx512vnni"] = f.avx512vnni; d["avx512vbmi"] = f.avx512vbmi; d["amx_tile"] = f.amx_tile; d["amx_bf16"] = f.amx_bf16; d["amx_int8"] = f.amx_int8;
    d["os_avx512"] = f.os_avx512; d["os_amx"] = f.os_amx;
    d["avx2"] = f.avx2; d["fma"] = f.fma; d["f16c"] = f.f16c; d["avxvnni"] = f.avxvnni; d["os_avx"] = f.os_avx;
    return d;
  });
  m.def("set_tuning", [](size_t pf_bytes, size_t task_kb, int64_t v_prefetch_kb, int pair_from) {  // between calls
    MOE_CHECK(task_kb >= 1, "task_kb must be >= 1");
    Tuning& t = tuning();
    t.pf_bytes = pf_bytes;
    t.task_bytes = task_kb * 1024;
    if (v_prefetch_kb >= 0) t.v_prefetch_bytes = size_t(v_prefetch_kb) * 1024;
    if (pair_from >= 0) t.pair_from_tokens = pair_from;
  }, py::arg("pf_bytes"), py::arg("task_kb"), py::arg("v_prefetch_kb") = -1, py::arg("pair_from") = -1,
     "the kernels' knobs (common.h Tuning), for benchmarks; v_prefetch_kb, pair_from -1: unchanged");
  m.def("get_tuning", [] {
    return py::make_tuple(tuning().pf_bytes, tuning().task_bytes / 1024, tuning().v_prefetch_bytes / 1024,
                          tuning().pair_from_tokens);
  });
  m.def("best_isa", [] { return std::string(isa_name(best_isa(detect_cpu()))); });
  m.def("set_torch_vector_bytes", &rounding::set_torch_vector_bytes, py::arg("bytes"),
        "torch's CPU vector width (64 AVX512, 32 AVX2, 0 DEFAULT): where its silu and sigmoid switch from Sleef's "
        "exp to libm's (native/kernels/torch_rounding.h)");
  m.def("torch_vector_bytes", &rounding::torch_vector_bytes);
  m.def("isa_supported", [](const std::string& p) { return isa_supported(parse_isa(p), detect_cpu()); });
  m.def("read_bandwidth", [](uintptr_t buf, size_t n, const std::string& variant) {
    py::gil_scoped_release nogil;
    std::lock_guard<std::mutex> g(compute_mutex());
    return read_bandwidth(reinterpret_cast<const float*>(buf), n, variant);
  }, py::arg("buf"), py::arg("n"), py::arg("variant") = "auto",
  "bytes/s streaming n floats on all pool threads; variant auto | avx512 | avx2 | scalar (checked against the CPU)");
  // arithmetic peaks (probes.h), each refused on a CPU without its instructions
  auto peak = [&m](const char* name, Isa needs, const char* what, double (*probe)(long)) {
    m.def(name, [=](long iters) {
      MOE_CHECK(isa_supported(needs, detect_cpu()), std::string("no ") + what + " on this CPU");
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> g(compute_mutex());
      return probe(iters);
    });
  };
  peak("bf16_peak_flops", Isa::Avx512, "AVX-512 BF16", bf16_peak_flops);
  peak("vnni_peak_ops", Isa::Avx512, "AVX-512 VNNI", vnni_peak_ops);
  peak("fma_peak_flops", Isa::Avx2, "AVX2 + FMA", fma_peak_flops);
  peak("avx2_int8_peak_ops", Isa::Avx2, "AVX2", avx2_int8_peak_ops);
  peak("avxvnni_peak_ops", Isa::AvxVnni, "AVX-VNNI", avxvnni_peak_ops);
  peak("amx_bf16_peak_flops", Isa::Amx, "AMX (or the OS refuses the tile state)", amx_bf16_peak_flops);
  peak("amx_int8_peak_ops", Isa::Amx, "AMX (or the OS refuses the tile state)", amx_int8_peak_ops);
  m.def("numa_topology", [] { return numa().describe(); }, "NUMA nodes the kernels place experts on");
  m.def(
      "numa_place", [](uintptr_t p, size_t bytes_per_expert, int E) {
        return numa_place(reinterpret_cast<void*>(p), bytes_per_expert, E);
      },
      py::arg("ptr"), py::arg("bytes_per_expert"), py::arg("E"),
      "bind expert e's slice to node e % nodes before first touch; returns slices bound (0 on one node)");
  m.def("numa_binds", &numa_binds, "whether numa_place binds memory here (several real NUMA nodes)");
  m.def("init_pool", [](int threads) { return pool(threads).size(); }, py::arg("threads"),
        "create the shared pool on first use (later calls return its size)");
  m.def("set_threads", [](int threads) { py::gil_scoped_release nogil; return resize_pool(threads); },
        py::arg("threads"), "rebuild the shared pool with this many threads (no work may be in flight)");
  m.def(
      "pool_check",
      [](int n_tasks, int fail_from) {
        py::gil_scoped_release nogil;
        std::lock_guard<std::mutex> g(compute_mutex());
        std::vector<int> hit(std::max(n_tasks, 0), 0);
        pool().parallel_for(n_tasks, [&](int i) {
          if (fail_from >= 0 && i >= fail_from) throw std::runtime_error("task " + std::to_string(i) + " failed");
          hit[i] = 1;
        });
        long done = 0;
        for (int h : hit) done += h;
        return done;
      },
      py::arg("n_tasks"), py::arg("fail_from") = -1,
      "tests: run n_tasks pool tasks, those from index fail_from on throwing; -> tasks that ran (all of them "
      "when none throws)");
  m.def("scratch_bytes", [] {
    std::lock_guard<std::mutex> g(compute_mutex());
    return pool().scratch.bytes();
  }, "bytes the kernels' scratch arena holds between calls");
  m.def("machine_shared", [] {
    py::gil_scoped_release nogil;
    return machine_shared();
  }, "whether waits now treat the machine as shared with other programs (native/runtime/contention.h)");
  m.def("contention_stats", [] {
    ContentionStats st;
    {
      py::gil_scoped_release nogil;
      st = contention_stats();
    }
    py::dict d;
    d["shared"] = st.shared, d["contended"] = st.contended, d["foreign_cpus"] = st.foreign_cpus;
    d["windows"] = st.windows, d["foreign_windows"] = st.foreign_windows, d["turned_shared"] = st.turned_shared;
    d["window_s"] = st.window_s, d["foreign_threshold"] = st.foreign_threshold;
    return d;
  }, "the waits' policy and the samples behind it, for the metrics (native/runtime/contention.h ContentionStats)");
}

}  // namespace moe

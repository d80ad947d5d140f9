// The expert exchange's bindings: the doorbells, the shared-memory ring (the expert side's serving loop, the GPU
// side's submit and result) and the native reader/writer of LayerRequest / LayerResult (native/exchange/).
#include <atomic>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings/bindings.h"
#include "exchange/doorbell.h"
#include "exchange/ring.h"
#include "exchange/wire.h"
#include "moe.h"
#include "runtime/common.h"

namespace moe {

namespace {

// A 32-bit doorbell word inside a writable buffer (an mmap of the shared region), bounds-checked.
std::atomic<uint32_t>* doorbell_at(py::buffer& buf, size_t offset) {
  py::buffer_info info = buf.request(true);
  size_t n = size_t(info.size) * size_t(info.itemsize);
  MOE_CHECK(offset % 4 == 0 && offset <= n && n - offset >= 4, "doorbell offset outside the buffer or unaligned");
  auto addr = reinterpret_cast<uintptr_t>(info.ptr) + offset;
  MOE_CHECK(addr % 4 == 0, "doorbell address unaligned");
  return reinterpret_cast<std::atomic<uint32_t>*>(addr);
}

// a serialized LayerResult with a 2-D output, read from a bytes-like object
bool read_result(py::buffer& buf, wire::LayerResultView& q) {
  py::buffer_info b = buf.request();
  return wire::parse_layer_result(static_cast<const uint8_t*>(b.ptr), size_t(b.size * b.itemsize), q) &&
         q.layer <= std::numeric_limits<uint32_t>::max() && q.output.shape.size() == 2;
}

// What the native readers of the exchange's bytes return (named fields, not positions).
struct ResultHead {
  uint64_t step, layer, part, dtype;
  int64_t rows, cols;
  size_t nbytes;
  wire::Timing timing;
};
struct ServeEvent {
  Served kind;
  uint64_t seq;
  std::vector<PartLog> parts;
};
struct RingAnswer {
  int status;  // Status, or -1: nothing yet (timed out, or the ring closed)
  py::bytes message;
  ring::RespDesc desc;
};

}  // namespace

void bind_exchange(py::module_& m) {
  m.def(
      "doorbell_ring",
      [](py::buffer buf, size_t offset, uint32_t value) { doorbell_ring(doorbell_at(buf, offset), value); },
      py::arg("buf"), py::arg("offset"), py::arg("value"), "store value at buf[offset] (release) and wake waiters");
  m.def(
      "doorbell_wait",
      [](py::buffer buf, size_t offset, uint32_t seen, int64_t timeout_us, int64_t spin_us) {
        std::atomic<uint32_t>* word = doorbell_at(buf, offset);
        py::gil_scoped_release nogil;
        return doorbell_wait(word, seen, timeout_us, spin_us);
      },
      py::arg("buf"), py::arg("offset"), py::arg("seen"), py::arg("timeout_us"), py::arg("spin_us"),
      "wait until buf[offset] != seen, at most timeout_us (spinning spin_us first, as the ring does): -> the value");
  m.def(
      "doorbell_wake", [](py::buffer buf, size_t offset) { doorbell_wake(doorbell_at(buf, offset)); },
      py::arg("buf"), py::arg("offset"), "wake waiters on buf[offset] without changing it");
  m.def("ring_layout", [] {
    using namespace ring;
    py::dict d;
    d["REQ_SEQ"] = REQ_SEQ; d["RESP_SEQ"] = RESP_SEQ; d["RESP_READ"] = RESP_READ; d["CLOSED"] = CLOSED;
    d["DESC_START"] = DESC_START; d["REQ_SLOTS"] = REQ_SLOTS; d["RESP_SLOTS"] = RESP_SLOTS;
    d["REQ_DESC_SIZE"] = REQ_DESC_SIZE; d["RESP_DESC_SIZE"] = RESP_DESC_SIZE; d["MSG_MAX"] = MSG_MAX;
    d["OK"] = uint32_t(OK); d["INVALID_ARGUMENT"] = uint32_t(INVALID_ARGUMENT); d["INTERNAL"] = uint32_t(INTERNAL);
    d["DATA_START"] = DATA_START; d["SPAN_ALIGN"] = SPAN_ALIGN; d["REQ_DESC_BYTES"] = sizeof(ReqDesc); d["RESP_DESC_BYTES"] = sizeof(RespDesc);
    return d;
  }, "the ring layout the C++ side uses (tests check moe_core/shm.py against it)");
  py::enum_<Served>(m, "ServeKind", "what one RingServer.serve() call ended with")
      .value("IDLE", Served::Idle)
      .value("CLOSED", Served::Closed)
      .value("FOR_PYTHON", Served::ForPython);
  py::class_<PartLog>(m, "PartLog", "one part the C++ loop computed, for the metrics")
      .def_readonly("layer", &PartLog::layer)
      .def_readonly("part", &PartLog::part)
      .def_readonly("tokens", &PartLog::tokens)
      .def_readonly("start_ns", &PartLog::start_ns)
      .def_readonly("end_ns", &PartLog::end_ns)
      .def_readonly("queued_ns", &PartLog::queued_ns);
  py::class_<ServeEvent>(m, "ServeEvent")
      .def_readonly("kind", &ServeEvent::kind)
      .def_readonly("seq", &ServeEvent::seq, "the request handed to Python (kind FOR_PYTHON)")
      .def_readonly("parts", &ServeEvent::parts, "parts computed since the last call");
  py::class_<RingServer>(m, "RingServer", "the expert side's serving loop of one shared-memory session")
      .def(py::init([](py::buffer region, int hidden, int max_tokens, int max_k, uint32_t code_f32, uint32_t code_bf16) {
             auto [p, n] = writable(region);
             return new RingServer(p, n, hidden, max_tokens, max_k, code_f32, code_bf16);
           }),
           py::arg("region"), py::arg("hidden"), py::arg("max_tokens"), py::arg("max_k"), py::arg("code_f32"),
           py::arg("code_bf16"), py::keep_alive<1, 2>())
      .def("add_layer", [](RingServer& r, int layer, const BoundMoELayer& l) { r.add_layer(layer, l.layer); },
           py::arg("layer"), py::arg("experts"), py::keep_alive<1, 3>())
      .def("serve",
           [](RingServer& r, int64_t timeout_us, int64_t spin_us) {
             ServeEvent ev{Served::Idle, 0, {}};
             py::gil_scoped_release nogil;
             ev.kind = r.serve(timeout_us, spin_us, &ev.seq, &ev.parts);
             return ev;
           },
           py::arg("timeout_us"), py::arg("spin_us"))
      .def("respond",
           [](RingServer& r, uint64_t seq, uint32_t part, uint32_t status, uint64_t off, uint64_t n, uint64_t queued_us,
              uint64_t compute_us, int64_t start_ns, int64_t end_ns, const std::string& msg) {
             py::gil_scoped_release nogil;
             return r.respond(seq, part, status, ring::Span{off, n}, queued_us, compute_us, start_ns, end_ns, msg);
           })
      .def("stop", &RingServer::stop)
      .def_property_readonly("served", &RingServer::served);
  m.def(
      "ring_submit",
      [](py::buffer region, uint64_t seq, uint64_t step, uint32_t layer, uint32_t T, uint32_t k, uint32_t defer,
         uint32_t dtype, uint64_t x_off, uint64_t x_n, uint64_t i_off, uint64_t i_n, uint64_t w_off, uint64_t w_n,
         uint64_t o_off, uint64_t o_n, uint64_t d_off, uint64_t d_n, uintptr_t x, uintptr_t ids, uintptr_t w,
         uint32_t posted) {
        auto [p, n] = writable(region);
        ring::ReqDesc d{seq, step, layer, T, k, defer, dtype, 0,
                        {{x_off, x_n}, {i_off, i_n}, {w_off, w_n}, {o_off, o_n}, {d_off, d_n}}};
        for (int i = 0; i < 3; ++i)  // our own spans: a bug here would write outside the region
          MOE_CHECK(d.span[i].off >= ring::DATA_START && d.span[i].off <= n && d.span[i].n <= n - d.span[i].off,
                    "submit: span outside the region");
        ring_submit(p, d, reinterpret_cast<const void*>(x), reinterpret_cast<const void*>(ids),
                    reinterpret_cast<const void*>(w), posted);
      },
      "GPU side: copy hidden/ids/weights into their spans, write the request descriptor, ring");
  py::class_<RingAnswer>(m, "RingAnswer", "one response of the ring as ring_result() read it")
      .def_readonly("status", &RingAnswer::status, "a gRPC status code (0 ok), -1 when none came in time")
      .def_readonly("message", &RingAnswer::message)
      .def_property_readonly("queued_us", [](const RingAnswer& a) { return a.desc.queued_us; })
      .def_property_readonly("compute_us", [](const RingAnswer& a) { return a.desc.compute_us; })
      .def_property_readonly("start_unix_ns", [](const RingAnswer& a) { return a.desc.start_ns; })
      .def_property_readonly("end_unix_ns", [](const RingAnswer& a) { return a.desc.end_ns; });
  m.def(
      "ring_result",
      [](py::buffer region, uint64_t j, uint64_t seq, uint32_t part, uintptr_t out, uint64_t nbytes, int64_t timeout_us,
         int64_t spin_us) {
        auto [p, n] = writable(region);
        RingAnswer a{0, py::bytes(), {}};
        std::string msg;
        {
          py::gil_scoped_release nogil;
          a.status = ring_result(p, n, j, seq, part, reinterpret_cast<void*>(out), nbytes, timeout_us, spin_us, &a.desc,
                                 &msg);
        }
        a.message = py::bytes(msg);
        return a;
      },
      "GPU side: wait for response j, check it, copy its output -> RingAnswer");
  py::class_<wire::Head>(m, "WireHead", "what the native exchange needs of a LayerRequest")
      .def_readonly("step", &wire::Head::step)
      .def_readonly("layer", &wire::Head::layer)
      .def_readonly("defer", &wire::Head::defer)
      .def_readonly("T", &wire::Head::T)
      .def_readonly("H", &wire::Head::H)
      .def_readonly("k", &wire::Head::k)
      .def_readonly("bf16", &wire::Head::bf16);
  m.def(
      "wire_head",
      [](py::buffer request) -> std::optional<wire::Head> {
        wire::LayerRequestView q;
        wire::Head h;
        if (!read_request(request, q, h)) return std::nullopt;
        return h;
      },
      py::arg("request"),
      "a serialized LayerRequest -> its WireHead when the native exchange can take it (native/exchange/wire.h: fast_head), "
      "else None");
  m.def(
      "wire_request",
      [](uint64_t step, uint32_t layer, uint32_t defer, uintptr_t hidden, uint64_t hidden_dtype, int itemsize, int64_t T,
         int64_t H, uintptr_t ids, uintptr_t weights, int64_t k) {
        MOE_CHECK(T >= 0 && H >= 0 && k >= 0 && (itemsize == 2 || itemsize == 4), "bad shape or itemsize");
        auto at = [](uintptr_t a) { return reinterpret_cast<const uint8_t*>(a); };
        const size_t nk = size_t(T) * size_t(k) * 4;
        wire::Request r{step, layer, defer, {hidden_dtype, T, H, at(hidden), size_t(T) * size_t(H) * itemsize},
                        {wire::INT32, T, k, at(ids), nk}, {wire::FLOAT32, T, k, at(weights), nk}};
        py::bytes b = new_bytes(wire::layer_request_size(r));
        wire::write_layer_request(bytes_data(b), r);
        return b;
      },
      py::arg("step"), py::arg("layer"), py::arg("defer"), py::arg("hidden"), py::arg("hidden_dtype"),
      py::arg("itemsize"), py::arg("T"), py::arg("H"), py::arg("ids"), py::arg("weights"), py::arg("k"),
      "a serialized LayerRequest from contiguous hidden [T, H], int32 ids and fp32 weights [T, k] at these addresses");
  py::class_<ResultHead>(m, "ResultHead", "a serialized LayerResult's fields, its output left in place")
      .def_readonly("step", &ResultHead::step)
      .def_readonly("layer", &ResultHead::layer)
      .def_readonly("part", &ResultHead::part)
      .def_readonly("dtype", &ResultHead::dtype, "the output's wire dtype (tensor.proto)")
      .def_readonly("rows", &ResultHead::rows)
      .def_readonly("cols", &ResultHead::cols)
      .def_readonly("nbytes", &ResultHead::nbytes, "the output's bytes")
      .def_property_readonly("queued_us", [](const ResultHead& h) { return h.timing.queued_us; })
      .def_property_readonly("compute_us", [](const ResultHead& h) { return h.timing.compute_us; })
      .def_property_readonly("start_unix_ns", [](const ResultHead& h) { return h.timing.start_unix_ns; })
      .def_property_readonly("end_unix_ns", [](const ResultHead& h) { return h.timing.end_unix_ns; });
  m.def(
      "wire_result",
      [](py::buffer result) -> std::optional<ResultHead> {
        wire::LayerResultView q;
        if (!read_result(result, q)) return std::nullopt;
        return ResultHead{q.step, q.layer, q.part, q.output.dtype, q.output.shape[0], q.output.shape[1], q.output.len,
                          q.timing};
      },
      py::arg("result"), "a serialized LayerResult -> its ResultHead, None when it is not one with a 2-D output");
  m.def(
      "wire_result_output",
      [](py::buffer result, uintptr_t out, size_t nbytes) {
        wire::LayerResultView q;
        MOE_CHECK(read_result(result, q) && q.output.len == nbytes, "not a LayerResult with an output of that many bytes");
        if (nbytes) std::memcpy(reinterpret_cast<void*>(out), q.output.data, nbytes);
      },
      py::arg("result"), py::arg("out"), py::arg("nbytes"), "copy a serialized LayerResult's output to `out`");
}

}  // namespace moe

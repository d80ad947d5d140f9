// What more than one area's bindings use (bindings/bind_<area>.cpp; module.cpp calls each bind_<area>): the
// parsers of kernel paths and KV types, the Python buffers' helpers, the serialized LayerRequest's reader and the
// objects one area binds and another takes. Raw pointers + shapes in (the Python layer owns the tensors).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include <pybind11/pybind11.h>

#include "exchange/wire.h"
#include "kernels/kernels.h"
#include "moe.h"

namespace py = pybind11;

namespace moe {

// one per area, in module.cpp's order
void bind_runtime(py::module_& m);
void bind_kernels(py::module_& m);
void bind_exchange(py::module_& m);
void bind_decode(py::module_& m);

inline Isa parse_isa(const std::string& name) {
  if (name == "portable") return Isa::Portable;
  if (name == "avx2") return Isa::Avx2;
  if (name == "avxvnni") return Isa::AvxVnni;
  if (name == "avx512") return Isa::Avx512;
  if (name == "amx") return Isa::Amx;
  throw std::invalid_argument("unknown kernel path '" + name + "' (portable, avx2, avxvnni, avx512, amx)");
}

inline Isa kernel_isa(const std::string& name) { return usable_isa(parse_isa(name)); }

inline py::bytes new_bytes(size_t n) {  // to be filled before anyone else sees it
  py::bytes b = py::reinterpret_steal<py::bytes>(PyBytes_FromStringAndSize(nullptr, py::ssize_t(n)));
  if (!b) throw py::error_already_set();
  return b;
}

inline uint8_t* bytes_data(py::bytes& b) { return reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(b.ptr())); }

// a serialized LayerRequest the native exchange takes (wire.h: fast_head), read from a bytes-like object
inline bool read_request(py::buffer& buf, wire::LayerRequestView& q, wire::Head& h) {
  py::buffer_info b = buf.request();
  return wire::parse_layer_request(static_cast<const uint8_t*>(b.ptr), size_t(b.size * b.itemsize), q) &&
         wire::fast_head(q, h);
}

inline std::pair<uint8_t*, size_t> writable(py::buffer& buf) {
  py::buffer_info info = buf.request(true);
  return {static_cast<uint8_t*>(info.ptr), size_t(info.size) * size_t(info.itemsize)};
}

inline KvType kv_type(int code) {  // moe_kernels/attention.py KV_CODES
  if (code < 0 || code > 4) throw std::invalid_argument("unknown KV cache type code " + std::to_string(code));
  return KvType(code);
}

// The bound objects keep `owner` (the Python object holding their buffers) alive as long as they live.
struct BoundMoELayer {
  MoELayer layer;
  py::object owner;
};
struct BoundLinear {
  const Kernels* k;
  Matrix m;
  py::object owner;
};

}  // namespace moe

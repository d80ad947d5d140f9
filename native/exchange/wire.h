// The expert exchange's two messages (protos/expert.proto: LayerRequest in, LayerResult out) read and
// written in C++, so a decode-sized layer request costs the expert service a handful of Python
// operations rather than a hundred (each costs microseconds, more so right after a kernel has
// streamed its weights through the caches). protos/*.proto stay the contract: this is a second
// reader/writer of the same bytes, checked against the protobuf library in tests/exchange/test_native_wire.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe::wire {

// protos/tensor.proto DType values this path handles (tests/exchange/test_native_wire.py checks them)
constexpr uint64_t FLOAT32 = 1, BFLOAT16 = 2, INT32 = 4;

struct TensorView {
  uint64_t dtype = 0;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t len = 0;
};

struct LayerRequestView {
  uint64_t step = 0, layer = 0, defer = 0;
  TensorView hidden, ids, weights;
};

// Protobuf wire format, proto3 rules (fields in any order, the last of a scalar wins, messages merge,
// shape packed or not, unknown fields skipped). false: malformed.
bool parse_layer_request(const uint8_t* p, size_t n, LayerRequestView& r);

// What the fast path takes: hidden [T, H] bf16|fp32, ids [T, k] int32, weights [T, k] fp32, k >= 1,
// byte lengths matching, layer and defer within uint32. Anything else goes to the protobuf path,
// which names what is wrong.
struct Head {
  uint64_t step;
  uint32_t layer, defer;
  int64_t T, H, k;
  bool bf16;
};
bool fast_head(const LayerRequestView& r, Head& h);

struct Timing {
  uint64_t queued_us = 0, compute_us = 0;
  int64_t start_unix_ns = 0, end_unix_ns = 0;
};

struct LayerResultView {
  uint64_t step = 0, layer = 0, part = 0;
  TensorView output;
  Timing timing;
};
bool parse_layer_result(const uint8_t* p, size_t n, LayerResultView& r);

// A [rows, cols] tensor to write: dtype (tensor.proto), its bytes.
struct Matrix2 {
  uint64_t dtype;
  int64_t rows, cols;
  const uint8_t* data;
  size_t len;
};

// The two messages in proto3's canonical bytes (zero scalars left out, shape packed), as the protobuf
// library writes them: *_size() bytes, then write_*() fills exactly that many.
struct Request {
  uint64_t step;
  uint32_t layer, defer;
  Matrix2 hidden, ids, weights;
};
size_t layer_request_size(const Request& r);
void write_layer_request(uint8_t* dst, const Request& r);

struct Result {
  uint64_t step;
  uint32_t layer, part;
  Matrix2 output;
  Timing timing;
};
size_t layer_result_size(const Result& r);
void write_layer_result(uint8_t* dst, const Result& r);

}  // namespace moe::wire

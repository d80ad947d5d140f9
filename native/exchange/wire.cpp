// Protobuf wire format for LayerRequest / LayerResult (see wire.h). Field numbers: protos/expert.proto
// and protos/tensor.proto.
#include "exchange/wire.h"

#include <algorithm>
#include <limits>

namespace moe::wire {
namespace {

enum WireType { VARINT = 0, I64 = 1, LEN = 2, I32 = 5 };

struct Reader {
  const uint8_t* p;
  const uint8_t* end;

  bool varint(uint64_t& v) {
    v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p == end) return false;
      uint8_t b = *p++;
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;  // more than 10 bytes
  }
  bool bytes(const uint8_t*& data, size_t& len) {
    uint64_t n;
    if (!varint(n) || n > uint64_t(end - p)) return false;
    data = p, len = size_t(n);
    p += n;
    return true;
  }
  bool skip(uint64_t wire_type) {
    uint64_t v;
    const uint8_t* d;
    size_t n;
    switch (wire_type) {
      case VARINT: return varint(v);
      case I64: if (end - p < 8) return false; p += 8; return true;
      case I32: if (end - p < 4) return false; p += 4; return true;
      case LEN: return bytes(d, n);
      default: return false;  // groups (3, 4) are not proto3; 6, 7 do not exist
    }
  }
};

// Walks a message's fields: on_varint(field, value) for each varint, on_len(field, data, len) for each
// length-delimited one (false: its content is malformed); other wire types are skipped, as are fields
// a callback does not know (protobuf keeps those as unknown fields). false: the message is malformed.
template <class OnVarint, class OnLen>
bool for_fields(const uint8_t* p, size_t n, OnVarint on_varint, OnLen on_len) {
  Reader r{p, p + n};
  while (r.p != r.end) {
    uint64_t key, v;
    const uint8_t* d;
    size_t len;
    if (!r.varint(key) || key >> 3 == 0) return false;
    uint64_t field = key >> 3, type = key & 7;
    if (type == VARINT) {
      if (!r.varint(v)) return false;
      on_varint(field, v);
    } else if (type == LEN) {
      if (!r.bytes(d, len) || !on_len(field, d, len)) return false;
    } else if (!r.skip(type)) {
      return false;
    }
  }
  return true;
}

bool parse_tensor(const uint8_t* p, size_t n, TensorView& t) {  // merges into t, as protobuf does
  return for_fields(
      p, n,
      [&](uint64_t field, uint64_t v) {
        if (field == 1) t.dtype = v;
        if (field == 2) t.shape.push_back(int64_t(v));  // shape, unpacked
      },
      [&](uint64_t field, const uint8_t* d, size_t len) {
        if (field == 3) t.data = d, t.len = len;
        if (field != 2) return true;
        Reader s{d, d + len};  // shape, packed
        for (uint64_t v; s.p != s.end; t.shape.push_back(int64_t(v)))
          if (!s.varint(v)) return false;
        return true;
      });
}

bool is_matrix(const TensorView& t, uint64_t dtype, int64_t itemsize, int64_t& rows, int64_t& cols) {
  if (t.dtype != dtype || t.shape.size() != 2) return false;
  rows = t.shape[0], cols = t.shape[1];
  constexpr int64_t lim = int64_t(1) << 31;  // keeps rows * cols * itemsize far from overflow
  return rows >= 0 && cols >= 0 && rows < lim && cols < lim && uint64_t(rows * cols) * itemsize == t.len;
}

size_t varint_size(uint64_t v) {
  size_t n = 1;
  while (v >= 0x80) v >>= 7, ++n;
  return n;
}

uint8_t* put_varint(uint8_t* d, uint64_t v) {
  while (v >= 0x80) *d++ = uint8_t(v) | 0x80, v >>= 7;
  *d++ = uint8_t(v);
  return d;
}

uint8_t* put_field(uint8_t* d, uint64_t field, uint64_t v) {  // a scalar, left out when zero (proto3)
  return v ? put_varint(put_varint(d, field << 3 | VARINT), v) : d;
}

size_t field_size(uint64_t field, uint64_t v) { return v ? varint_size(field << 3) + varint_size(v) : 0; }

size_t len_field_size(uint64_t field, size_t len) { return varint_size(field << 3 | LEN) + varint_size(len) + len; }

size_t shape_size(const Matrix2& t) { return varint_size(uint64_t(t.rows)) + varint_size(uint64_t(t.cols)); }

size_t tensor_size(const Matrix2& t) {
  return field_size(1, t.dtype) + len_field_size(2, shape_size(t)) + (t.len ? len_field_size(3, t.len) : 0);
}

uint8_t* put_tensor(uint8_t* d, uint64_t field, const Matrix2& t) {
  d = put_varint(put_varint(d, field << 3 | LEN), tensor_size(t));
  d = put_field(d, 1, t.dtype);
  d = put_varint(put_varint(d, 2 << 3 | LEN), shape_size(t));
  d = put_varint(put_varint(d, uint64_t(t.rows)), uint64_t(t.cols));
  if (t.len) {
    d = put_varint(put_varint(d, 3 << 3 | LEN), t.len);
    d = std::copy(t.data, t.data + t.len, d);
  }
  return d;
}

size_t timing_size(const Timing& t) {
  return field_size(1, t.queued_us) + field_size(2, t.compute_us) + field_size(3, uint64_t(t.start_unix_ns)) +
         field_size(4, uint64_t(t.end_unix_ns));
}

bool parse_timing(const uint8_t* p, size_t n, Timing& t) {  // merges into t
  return for_fields(
      p, n,
      [&](uint64_t field, uint64_t v) {
        if (field == 1) t.queued_us = v;
        if (field == 2) t.compute_us = v;
        if (field == 3) t.start_unix_ns = int64_t(v);
        if (field == 4) t.end_unix_ns = int64_t(v);
      },
      [](uint64_t, const uint8_t*, size_t) { return true; });
}

}  // namespace

bool parse_layer_request(const uint8_t* p, size_t n, LayerRequestView& q) {
  return for_fields(
      p, n,
      [&](uint64_t field, uint64_t v) {
        if (field == 1) q.step = v;
        if (field == 2) q.layer = v;
        if (field == 6) q.defer = v;
      },
      [&](uint64_t field, const uint8_t* d, size_t len) {
        TensorView* t = field == 3 ? &q.hidden : field == 4 ? &q.ids : field == 5 ? &q.weights : nullptr;
        return !t || parse_tensor(d, len, *t);
      });
}

bool fast_head(const LayerRequestView& r, Head& h) {
  constexpr uint64_t u32 = std::numeric_limits<uint32_t>::max();
  if (r.layer > u32 || r.defer > u32) return false;
  int64_t T, H, T2, k, T3, k2;
  bool bf16 = r.hidden.dtype == BFLOAT16;
  if (!is_matrix(r.hidden, bf16 ? BFLOAT16 : FLOAT32, bf16 ? 2 : 4, T, H) || !is_matrix(r.ids, INT32, 4, T2, k) ||
      !is_matrix(r.weights, FLOAT32, 4, T3, k2) || T2 != T || T3 != T || k2 != k || k < 1)
    return false;
  h = Head{r.step, uint32_t(r.layer), uint32_t(r.defer), T, H, k, bf16};
  return true;
}

bool parse_layer_result(const uint8_t* p, size_t n, LayerResultView& q) {
  return for_fields(
      p, n,
      [&](uint64_t field, uint64_t v) {
        if (field == 1) q.step = v;
        if (field == 2) q.layer = v;
        if (field == 3) q.part = v;
      },
      [&](uint64_t field, const uint8_t* d, size_t len) {
        return field == 4 ? parse_tensor(d, len, q.output) : field == 5 ? parse_timing(d, len, q.timing) : true;
      });
}

size_t layer_request_size(const Request& r) {
  return field_size(1, r.step) + field_size(2, r.layer) + len_field_size(3, tensor_size(r.hidden)) +
         len_field_size(4, tensor_size(r.ids)) + len_field_size(5, tensor_size(r.weights)) + field_size(6, r.defer);
}

void write_layer_request(uint8_t* d, const Request& r) {
  d = put_field(d, 1, r.step);
  d = put_field(d, 2, r.layer);
  d = put_tensor(d, 3, r.hidden);
  d = put_tensor(d, 4, r.ids);
  d = put_tensor(d, 5, r.weights);
  put_field(d, 6, r.defer);
}

size_t layer_result_size(const Result& r) {
  return field_size(1, r.step) + field_size(2, r.layer) + field_size(3, r.part) +
         len_field_size(4, tensor_size(r.output)) + len_field_size(5, timing_size(r.timing));
}

void write_layer_result(uint8_t* d, const Result& r) {
  d = put_field(d, 1, r.step);
  d = put_field(d, 2, r.layer);
  d = put_field(d, 3, r.part);
  d = put_tensor(d, 4, r.output);
  const Timing& t = r.timing;
  d = put_varint(put_varint(d, 5 << 3 | LEN), timing_size(t));
  d = put_field(d, 1, t.queued_us);
  d = put_field(d, 2, t.compute_us);
  d = put_field(d, 3, uint64_t(t.start_unix_ns));
  put_field(d, 4, uint64_t(t.end_unix_ns));
}

}  // namespace moe::wire

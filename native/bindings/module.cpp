// The Python module moe_kernels._native: one bind_<area> a folder of native/ (bindings/bind_<area>.cpp), raw
// pointers + shapes in (the Python layer owns the tensors), GIL released.
#include "bindings/bindings.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "Native routed-expert kernels (see native/)";
  moe::bind_runtime(m);
  moe::bind_kernels(m);
  moe::bind_exchange(m);
  moe::bind_decode(m);
}

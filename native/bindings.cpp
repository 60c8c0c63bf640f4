// The only pybind11 file: exposes the C++ core as pagedinfer._native.
#include <pybind11/pybind11.h>

#include "pagedinfer/version.h"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
  m.doc() = "paged-infer native paged KV-cache core";
  m.def("version", &pagedinfer::version);
}

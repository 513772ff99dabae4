// nanobind module exposing the XLA FFI handlers as PyCapsules.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

namespace pzsc {
int KernelAbiVersion();
}

NB_MODULE(_pzsc_ffi, m) {
  m.def("abi_version", &pzsc::KernelAbiVersion);
  m.def("registrations", []() { return nb::dict(); });
}

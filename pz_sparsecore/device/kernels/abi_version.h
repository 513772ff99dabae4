// The version of the compiled extension's ABI: the one place it is written.
//
// The extension reports it (abi_version(), csrc/module.cc) and the Python
// package expects the number written here (ffi.py reads this file, which
// ships inside the package beside it; the C++ build includes it from here),
// so a build older or newer than the Python code is refused, never run.
//
// Bump it when a handler's operands, attributes or contract change, or a
// target other than an optimizer's is added or removed, or the module's
// functions change. Adding or removing an optimizer needs no bump: the
// extension's optimizers() description, generated from
// csrc/optimizer_list.h, is checked against the registry.
#ifndef PZSC_ABI_VERSION_H_
#define PZSC_ABI_VERSION_H_

namespace pzsc {
inline constexpr int kAbiVersion = 10;
}  // namespace pzsc

#endif  // PZSC_ABI_VERSION_H_

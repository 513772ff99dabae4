// Placeholder translation unit; the kernel sources replace it.
namespace pzsc {
int KernelAbiVersion() { return 1; }
}  // namespace pzsc

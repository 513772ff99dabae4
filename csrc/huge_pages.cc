#include "huge_pages.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pzsc {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Most address ranges remembered; the oldest is forgotten first.
constexpr size_t kMaxRanges = 64;
// MADV_COLLAPSE (Linux 6.1), spelled out for older headers.
constexpr int kMadvCollapse = 25;

bool Enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("PZSC_HUGE_PAGES");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

// The 2 MiB-aligned interior of [data, data + bytes), or false if empty or
// the buffer is too small to bother.
bool Interior(const void* data, size_t bytes, uintptr_t* begin,
              uintptr_t* end) {
  if (bytes < kMinHugePageBytes || !Enabled()) return false;
  const uintptr_t lo = reinterpret_cast<uintptr_t>(data);
  *begin = (lo + kHugePage - 1) & ~(kHugePage - 1);
  *end = (lo + bytes) & ~(kHugePage - 1);
  return *begin < *end;
}

void Advise(uintptr_t begin, uintptr_t end, bool collapse) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* p = reinterpret_cast<void*>(begin);
  const size_t n = end - begin;
  if (madvise(p, n, MADV_HUGEPAGE) != 0) return;  // No THP: nothing to do.
  if (collapse) madvise(p, n, kMadvCollapse);     // EINVAL before 6.1, etc.
#else
  (void)begin;
  (void)end;
  (void)collapse;
#endif
}

}  // namespace

void AdviseHugePages(const void* data, size_t bytes) {
  uintptr_t begin, end;
  if (!Interior(data, bytes, &begin, &end)) return;
  static std::mutex mu;
  static std::vector<std::pair<uintptr_t, uintptr_t>> seen;
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& r : seen) {
      if (r.first == begin && r.second == end) return;
    }
    if (seen.size() == kMaxRanges) seen.erase(seen.begin());
    seen.emplace_back(begin, end);
  }
  Advise(begin, end, /*collapse=*/true);
}

void AdviseHugePagesBeforeFirstTouch(void* data, size_t bytes) {
  uintptr_t begin, end;
  if (Interior(data, bytes, &begin, &end)) Advise(begin, end, false);
}

}  // namespace pzsc

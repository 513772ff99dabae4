#include "huge_pages.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace pzsc {
namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
// Most address ranges remembered; the oldest is forgotten first.
constexpr size_t kMaxRanges = 64;
// MADV_COLLAPSE (Linux 6.1), spelled out for older headers.
constexpr int kMadvCollapse = 25;

// A range advised before: whether its collapse succeeded.
struct Range {
  uintptr_t begin;
  uintptr_t end;
  bool collapsed;
};

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

// Advises [begin, end) MADV_HUGEPAGE, then (if `collapse`) MADV_COLLAPSE;
// returns whether the range is now backed by huge pages (false without THP,
// before Linux 6.1, or when no huge page could be had).
bool Advise(uintptr_t begin, uintptr_t end, bool collapse) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  void* p = reinterpret_cast<void*>(begin);
  const size_t n = end - begin;
  if (madvise(p, n, MADV_HUGEPAGE) != 0) return false;  // No THP.
  return collapse && madvise(p, n, kMadvCollapse) == 0;
#else
  (void)begin;
  (void)end;
  (void)collapse;
  return false;
#endif
}

#if defined(__linux__)
// PAGEMAP_SCAN (Linux 6.7, linux/fs.h), spelled out for older headers.
struct PmScanArg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages,
      category_inverted, category_mask, category_anyof_mask, return_mask;
};
struct PageRegion {
  uint64_t start, end, categories;
};
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);
constexpr uint64_t kPageIsHuge = uint64_t{1} << 6;
#endif

// Whether the huge page at `begin` is still a huge page: 1 yes, 0 no (the
// range was freed and its address reused by a buffer of 4 KiB pages, or the
// kernel split it), -1 unknown (before Linux 6.7). One page-table lookup.
int StillHuge(uintptr_t begin) {
#if defined(__linux__)
  static const int fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  PageRegion region{};
  PmScanArg arg{};
  arg.size = sizeof(arg);
  arg.start = begin;
  arg.end = begin + kHugePage;
  arg.vec = reinterpret_cast<uintptr_t>(&region);
  arg.vec_len = 1;
  arg.max_pages = 1;
  // The first page that is not huge, if any.
  arg.category_inverted = kPageIsHuge;
  arg.category_mask = kPageIsHuge;
  arg.return_mask = kPageIsHuge;
  const int found = ioctl(fd, kPagemapScan, &arg);
  return found < 0 ? -1 : found == 0;
#else
  (void)begin;
  return -1;
#endif
}

}  // namespace

void AdviseHugePages(const void* data, size_t bytes) {
  uintptr_t begin, end;
  if (!Interior(data, bytes, &begin, &end)) return;
  static std::mutex mu;
  static std::vector<Range> seen;
  const auto find = [&]() -> Range* {
    for (Range& r : seen) {
      if (r.begin == begin && r.end == end) return &r;
    }
    return nullptr;
  };
  int seen_collapsed = -1;  // -1: not seen.
  {
    std::lock_guard<std::mutex> lock(mu);
    if (const Range* r = find()) seen_collapsed = r->collapsed;
  }
  // A failed collapse is not retried on every call. A collapsed range is
  // checked (one page-table lookup where the kernel can, outside the lock):
  // a buffer freed and allocated again at the same address has 4 KiB pages.
  if (seen_collapsed == 0 || (seen_collapsed == 1 && StillHuge(begin) != 0)) {
    return;
  }
  const bool collapsed = Advise(begin, end, /*collapse=*/true);
  std::lock_guard<std::mutex> lock(mu);
  if (Range* r = find()) {
    r->collapsed = collapsed;
    return;
  }
  if (seen.size() == kMaxRanges) seen.erase(seen.begin());
  seen.push_back({begin, end, collapsed});
}

void AdviseHugePagesBeforeFirstTouch(void* data, size_t bytes) {
  uintptr_t begin, end;
  if (Interior(data, bytes, &begin, &end)) Advise(begin, end, false);
}

}  // namespace pzsc

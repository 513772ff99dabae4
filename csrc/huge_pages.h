// Transparent huge pages for large table and slot buffers.
//
// Random row gathers from a multi-GiB table take a TLB miss (and page walk)
// per row on 4 KiB pages. numpy madvises its large arrays MADV_HUGEPAGE, but
// XLA's CPU buffers are plain 4 KiB pages, and with THP in "madvise" mode
// (the common default) they stay that way. The handlers therefore advise the
// table and slot buffers themselves: the first time a buffer of at least
// kMinHugePageBytes is seen (address range remembered in a small set), its
// 2 MiB-aligned interior gets MADV_HUGEPAGE and then MADV_COLLAPSE (Linux
// >= 6.1), which synchronously rebuilds the already-faulted range from huge
// pages (a one-time cost of about 0.3-0.5 s per GiB, seconds when memory must
// be compacted). Contents never change; failures (old kernels, THP off, no
// free huge pages) are ignored. PZSC_HUGE_PAGES=0 in the environment turns
// this off. Seen again, a collapsed range is checked with one page-table
// lookup (PAGEMAP_SCAN, Linux >= 6.7; about a microsecond): a buffer freed
// and allocated again at the same address (a new table after a restore, the
// next benchmark's) has 4 KiB pages and is collapsed in turn. Before 6.7,
// and after a failed collapse, a range is advised once. The backward also
// advises fresh (non-aliased) result buffers before copying into them, so
// they fault in as huge pages.
#ifndef PZSC_CSRC_HUGE_PAGES_H_
#define PZSC_CSRC_HUGE_PAGES_H_

#include <cstddef>
#include <cstdint>

namespace pzsc {

// Buffers smaller than this are left alone (their pages fit the TLB reach).
inline constexpr size_t kMinHugePageBytes = size_t{32} << 20;

// Asks for huge pages behind [data, data + bytes) once per address range (see
// above). Cheap after the first call for a range; never fails.
void AdviseHugePages(const void* data, size_t bytes);

// MADV_HUGEPAGE only, no collapse and no memory of the range: for a buffer
// about to be written for the first time, so that its page faults allocate
// huge pages directly.
void AdviseHugePagesBeforeFirstTouch(void* data, size_t bytes);

}  // namespace pzsc

#endif  // PZSC_CSRC_HUGE_PAGES_H_

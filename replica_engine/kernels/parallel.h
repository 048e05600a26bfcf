// How every kernel splits its work across torch's threads.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

// fn(first, last) over [0, n) in chunks of `chunk`, each handed to whichever thread asks next
// (at::parallel_for gives each thread one fixed share). The cores are shared with Ray's processes
// and the replica's event loop: a thread that loses its core for a while then holds up only the
// chunk it has, where a fixed share kept the whole step waiting for it. Inline when one chunk.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, const Fn& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks <= 1 || at::get_num_threads() == 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
}

#include "aidaptiv/detail/test_hooks.hpp"

#include <new>

namespace aidaptiv::detail::testing {

namespace {
std::atomic<int> submit_err{0};
std::atomic<unsigned> submit_failures{0};
std::atomic<unsigned> completion_throws{0};

// Decrements counter if it is positive; true when it was (one armed fault taken).
bool take_one(std::atomic<unsigned>& counter) noexcept {
  unsigned n = counter.load(std::memory_order_relaxed);
  while (n > 0 && !counter.compare_exchange_weak(n, n - 1, std::memory_order_relaxed)) {
  }
  return n > 0;
}
}  // namespace

void fail_next_submits(int err, unsigned count) noexcept {
  submit_err.store(err, std::memory_order_relaxed);
  submit_failures.store(count, std::memory_order_relaxed);
}

int take_submit_failure() noexcept {
  return take_one(submit_failures) ? -submit_err.load(std::memory_order_relaxed) : 0;
}

void throw_in_next_completions(unsigned count) noexcept { completion_throws.store(count, std::memory_order_relaxed); }

void maybe_throw_in_completion() {
  if (take_one(completion_throws)) throw std::bad_alloc();
}

}  // namespace aidaptiv::detail::testing

// Fault-injection hooks for the test suite, compiled into every build (the wheel is built once, so a
// compile-time switch would never reach the tests). Each hook is off unless a test arms it through
// aidaptiv_ds.engine._C._testing_*; when off it costs one relaxed atomic load. They are process-wide: tests
// arm them in a child process of their own.
#pragma once

#include <atomic>

namespace aidaptiv::detail::testing {

// The next `count` io_uring_submit calls (of any engine) fail with -err instead of entering the kernel.
void fail_next_submits(int err, unsigned count) noexcept;
// -errno to return instead of submitting, or 0 to submit for real. Consumes one armed failure.
int take_submit_failure() noexcept;

// The next `count` completions checked by a completion thread (io_uring reaper or POSIX worker) throw
// std::bad_alloc before they are checked, as an allocation failure there would.
void throw_in_next_completions(unsigned count) noexcept;
// Throws std::bad_alloc when armed. Called where a completion is about to be checked.
void maybe_throw_in_completion();

}  // namespace aidaptiv::detail::testing

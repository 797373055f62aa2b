// The interface between the engine and its two backends (io_uring, POSIX thread pool).
#pragma once

#include <memory>
#include <string>

#include "aidaptiv/detail/request.hpp"

namespace aidaptiv {
class PinnedPool;
}

namespace aidaptiv::detail {

struct BackendOptions {
  uint64_t block_size = 1ull << 20;
  unsigned queue_depth = 32;
  unsigned threads = 4;
  bool sqpoll = false;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // Queues r; never throws for I/O errors, which land in r and are raised at wait. r stays alive
  // until it is marked done.
  virtual void submit(Request* r) = 0;
  // Stops the backend's threads. The caller has waited for every request first.
  virtual void shutdown() noexcept = 0;
  virtual const char* name() const = 0;
  // Whether the pinned pool is registered (io_uring fixed buffers), and if not, why.
  virtual bool fixed_buffers() const { return false; }
  virtual std::string fixed_buffers_note() const { return ""; }
  virtual std::string setup_note() const { return ""; }
};

// Throws SystemError when io_uring cannot start (not compiled in the kernel, blocked by seccomp, ...).
std::unique_ptr<Backend> make_uring_backend(const BackendOptions& options, const std::shared_ptr<PinnedPool>& pool,
                                            Counters* counters);
std::unique_ptr<Backend> make_posix_backend(const BackendOptions& options, Counters* counters);

}  // namespace aidaptiv::detail

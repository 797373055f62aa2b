// The POSIX backend: a pool of threads doing pread/pwrite, piece by piece, with the same pieces,
// checks and error semantics as the io_uring backend. It is the fallback where io_uring is disabled
// (seccomp, sysctl, old kernels) and the reference the io_uring backend is compared with.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "aidaptiv/detail/backend.hpp"
#include "aidaptiv/error.hpp"

namespace aidaptiv::detail {

namespace {

class PosixBackend final : public Backend {
 public:
  PosixBackend(const BackendOptions& options, Counters* counters) : queue_(options.block_size, counters) {
    for (unsigned i = 0; i < options.threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~PosixBackend() override { shutdown(); }

  const char* name() const override { return "posix"; }

  void submit(Request* r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push(r);
    }
    cv_.notify_all();
  }

  void shutdown() noexcept override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
  }

 private:
  void work() noexcept {
    try {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        Piece p;
        cv_.wait(lock, [&] { return queue_.next(&p) || stopping_; });
        if (!p.req) return;  // stopping, and nothing left to cut
        bool again;
        do {
          const int fd = p.fd();
          lock.unlock();
          const int64_t res = fd < 0 ? fd : transfer(p, fd);
          lock.lock();
          again = queue_.complete(p, res);
        } while (again);
      }
    } catch (...) {
      // Only allocation failures can get here; nothing may escape a thread.
    }
  }

  static int64_t transfer(const Piece& p, int fd) {
    const ssize_t n = p.req->op == Op::Read ? pread(fd, p.buf, p.len, static_cast<off_t>(p.offset))
                                            : pwrite(fd, p.buf, p.len, static_cast<off_t>(p.offset));
    return n < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(n);
  }

  PieceQueue queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_posix_backend(const BackendOptions& options, Counters* counters) {
  return std::make_unique<PosixBackend>(options, counters);
}

}  // namespace aidaptiv::detail

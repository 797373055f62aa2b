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
#include "aidaptiv/detail/test_hooks.hpp"
#include "aidaptiv/error.hpp"

namespace aidaptiv::detail {

namespace {

// What a request fails with when a worker could not check one of its transfers.
constexpr const char* kWorkerFailure =
    "an I/O worker thread ran out of memory while checking this transfer, so its result is unknown "
    "(ENOMEM): free host memory (or lower threads) and submit the request again";

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
  // A worker never ends before shutdown: an exception while it checks a transfer (an allocation
  // failing as an error message is built, or the test hook) fails that piece's request with ENOMEM and
  // the worker goes on, so no waiter hangs on a piece nobody holds. The transfer itself has returned by
  // then, so failing the piece releases no buffer under I/O.
  void work() noexcept {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      Piece p;
      cv_.wait(lock, [&] { return queue_.next(&p) || stopping_; });
      if (!p.req) return;  // stopping, and nothing left to cut
      bool again = true;
      while (again) {
        const int fd = p.fd();
        lock.unlock();
        const int64_t res = fd < 0 ? fd : transfer(p, fd);
        lock.lock();
        try {
          testing::maybe_throw_in_completion();
          again = queue_.complete(p, res);
        } catch (...) {
          queue_.fail_noexcept(p, ENOMEM, kWorkerFailure);
          again = false;
        }
      }
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

// The io_uring backend (liburing 2.3 API only).
//
// Threads: any number of submitting threads take mu_ and put pieces straight into the submission
// queue (SQ); one completion thread (the reaper) waits on the completion queue (CQ) without the lock,
// takes a batch of completions with io_uring_peek_batch_cqe, then under mu_ checks every one, queues
// short transfers and retries again, and fills the slots that came free with pending pieces. The CQ is
// only ever touched by the reaper, the SQ only under mu_; liburing's wait does not touch the SQ.
//
// At most queue_depth pieces are in flight: each has a slot (index = user_data), preallocated, so
// the hot path allocates nothing.
//
// Files are not registered (IORING_REGISTER_FILES): that saves the kernel one file-table lookup and
// reference count per SQE, some 50 ns against the hundreds of microseconds a 1 MiB piece takes, while
// files opened per request (DeepSpeed passes a path per call) would need a table update for each.
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "aidaptiv/detail/backend.hpp"
#include "aidaptiv/detail/test_hooks.hpp"
#include "aidaptiv/error.hpp"
#include "aidaptiv/pinned_pool.hpp"

namespace aidaptiv::detail {

namespace {

constexpr uint64_t kStopTag = ~0ull;
// An SQE whose piece was failed before the kernel took it, rewritten as a NOP (see
// fail_unsubmitted_locked); its completion is ignored.
constexpr uint64_t kNeutralisedTag = ~0ull - 1;

// What a request fails with when the completion thread could not check one of its transfers.
constexpr const char* kCompletionThreadFailure =
    "the io_uring completion thread ran out of memory while checking this transfer, so its result is "
    "unknown (ENOMEM): free host memory (or lower queue_depth) and submit the request again";

std::string uring_setup_advice(int err) {
  switch (err) {
    case ENOSYS:
      return "this kernel has no io_uring; use backend='posix' or a kernel >= 5.10";
    case EPERM:
    case EACCES:
      return "io_uring is disabled here (sysctl kernel.io_uring_disabled, or a seccomp policy such as a "
             "container runtime's default); use backend='posix' or allow io_uring";
    case ENOMEM:
      return "the kernel could not allocate the rings (older kernels charge them to the locked-memory "
             "limit); raise ulimit -l or lower queue_depth";
    default:
      return "use backend='posix'";
  }
}

class UringBackend final : public Backend {
 public:
  UringBackend(const BackendOptions& options, const std::shared_ptr<PinnedPool>& pool, Counters* counters)
      : queue_(options.block_size, counters), pool_(pool) {
    setup_ring(options);
    if (pool) register_pool(*pool);
    slots_.resize(options.queue_depth);
    free_.reserve(options.queue_depth);
    for (unsigned i = options.queue_depth; i-- > 0;) free_.push_back(i);
    retry_.reserve(options.queue_depth);
    cqes_.resize(options.queue_depth + 1);
    reaper_ = std::thread([this] { reap_loop(); });
  }

  ~UringBackend() override {
    shutdown();
    io_uring_queue_exit(&ring_);
  }

  const char* name() const override { return "io_uring"; }
  bool fixed_buffers() const override { return fixed_; }
  std::string fixed_buffers_note() const override { return fixed_note_; }
  std::string setup_note() const override { return setup_note_; }

  void submit(Request* r) override {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push(r);
    if (submit_err_) {
      queue_.fail_all_queued(submit_err_, submit_err_message_ + " (for " + r->file->path() + ")");
      return;
    }
    fill_locked();
    submit_locked();
    in_kernel_.store(in_flight_ - static_cast<unsigned>(retry_.size()), std::memory_order_relaxed);
  }

  void shutdown() noexcept override {
    if (!reaper_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      // A NOP wakes the reaper at once; the timed wait below is the safety net if it cannot be queued.
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe) {
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, kStopTag);
        submit_locked();
      }
    }
    reaper_.join();
  }

 private:
  void setup_ring(const BackendOptions& options) {
    // Setup flags we ask for, newest first, each dropped (with a note) when the kernel refuses it:
    //  SQPOLL     (only when asked) a kernel thread polls the SQ: saves submit syscalls but burns a core;
    //             measured slower on this kind of shared VM, hence off by default.
    //  SUBMIT_ALL (5.18) keep submitting the rest of a batch when one SQE fails at submit time, so its
    //             error arrives as a CQE like any other.
    //  CLAMP      (5.6) clamp an over-large queue depth to the kernel's maximum instead of failing.
    // Not asked for: COOP_TASKRUN / DEFER_TASKRUN and SINGLE_ISSUER: completions' task work runs in the
    // task that submitted, and several Python threads submit here; with cooperative task running a
    // submitter asleep in wait() would never post its own completion. IOPOLL: the disk here does not
    // support polled I/O (and it would need a poller thread spinning).
    struct Flag {
      unsigned bit;
      const char* name;
    };
    std::vector<Flag> flags = {{IORING_SETUP_CLAMP, "CLAMP"}, {IORING_SETUP_SUBMIT_ALL, "SUBMIT_ALL"}};
    if (options.sqpoll) flags.push_back({IORING_SETUP_SQPOLL, "SQPOLL"});
    for (;;) {
      io_uring_params params{};
      for (const Flag& f : flags) params.flags |= f.bit;
      if (options.sqpoll) params.sq_thread_idle = 100;  // ms before the SQ thread sleeps
      const int ret = io_uring_queue_init_params(options.queue_depth, &ring_, &params);
      if (ret == 0) {
        features_ = params.features;
        return;
      }
      if (ret == -EINVAL && !flags.empty()) {
        setup_note_ += std::string(setup_note_.empty() ? "" : "; ") + "the kernel refused IORING_SETUP_" +
                       flags.back().name + ", running without it";
        flags.pop_back();
        continue;
      }
      throw SystemError(-ret, "",
                        "starting io_uring (io_uring_setup with " + std::to_string(options.queue_depth) +
                            " entries) failed: " + errno_text(-ret) + ": " + uring_setup_advice(-ret));
    }
  }

  void register_pool(const PinnedPool& pool) {
    // Fixed buffers: the kernel pins the pool's pages once instead of per I/O. One iovec may not
    // exceed 1 GiB, so the pool goes in as consecutive 1 GiB chunks.
    FixedRegion region;
    region.base = pool.base();
    region.length = pool.capacity();
    std::vector<iovec> iov;
    for (uint64_t off = 0; off < region.length; off += region.chunk) {
      iov.push_back({region.base + off, static_cast<size_t>(std::min(region.chunk, region.length - off))});
    }
    const int ret = io_uring_register_buffers(&ring_, iov.data(), static_cast<unsigned>(iov.size()));
    if (ret == 0) {
      fixed_ = true;
      queue_.set_fixed_region(region);
      return;
    }
    fixed_note_ = "registering the pinned pool (" + std::to_string(region.length) +
                  " bytes) as io_uring fixed buffers failed: " + errno_text(-ret) +
                  ": plain buffers are used instead (slightly more CPU per I/O); raise the locked-memory "
                  "limit (ulimit -l) to at least the pool size to register it";
  }

  void release_locked(uint32_t slot) {
    slots_[slot].req = nullptr;
    free_.push_back(slot);
    in_flight_--;
  }

  // Puts the piece of slot into an SQE. False when the SQ is full (cannot happen while at most
  // queue_depth pieces are in flight; kept as a guard).
  bool prep_locked(uint32_t slot) {
    Piece& p = slots_[slot];
    if (p.req->failed) {  // its request failed while this piece waited for a retry
      queue_.finish(p);
      release_locked(slot);
      return true;
    }
    const int fd = p.fd();
    if (fd < 0) {
      queue_.fail(p, -fd, PieceQueue::describe(p) + " failed: opening its buffered descriptor: " +
                              errno_text(-fd) + ": " + errno_advice(-fd));
      release_locked(slot);
      return true;
    }
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (!sqe) return false;
    const unsigned len = static_cast<unsigned>(p.len);
    if (p.req->op == Op::Read) {
      if (p.fixed_index >= 0)
        io_uring_prep_read_fixed(sqe, fd, p.buf, len, p.offset, p.fixed_index);
      else
        io_uring_prep_read(sqe, fd, p.buf, len, p.offset);
    } else {
      if (p.fixed_index >= 0)
        io_uring_prep_write_fixed(sqe, fd, p.buf, len, p.offset, p.fixed_index);
      else
        io_uring_prep_write(sqe, fd, p.buf, len, p.offset);
    }
    io_uring_sqe_set_data64(sqe, slot);
    return true;
  }

  void fill_locked() {
    for (;;) {
      // Retries and short-transfer remainders first: they already hold slots. A slot stays in retry_
      // until its SQE is prepared, so an exception in prep_locked never loses a piece.
      while (!retry_.empty()) {
        if (!prep_locked(retry_.back())) return;
        retry_.pop_back();
      }
      Piece p;
      if (free_.empty() || !queue_.next(&p)) return;
      const uint32_t slot = free_.back();
      free_.pop_back();
      slots_[slot] = p;
      in_flight_++;
      retry_.push_back(slot);  // capacity reserved: never allocates
    }
  }

  void submit_locked() {
    int busy_rounds = 0;
    while (io_uring_sq_ready(&ring_) > 0) {
      int ret = testing::take_submit_failure();
      if (ret == 0) ret = io_uring_submit(&ring_);
      if (ret > 0 || ret == -EINTR) continue;
      const unsigned unsubmitted = io_uring_sq_ready(&ring_);
      if ((ret == 0 || ret == -EAGAIN || ret == -EBUSY) && busy_rounds++ < 10000) {
        // The kernel is short of resources or the CQ is full. With completions still to come, the
        // reaper submits again after reaping; with none, nothing else would, so back off and retry.
        if (in_flight_ > unsubmitted + retry_.size()) return;
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        continue;
      }
      const int err = ret < 0 ? -ret : EAGAIN;
      fail_unsubmitted_locked(err);
      return;
    }
  }

  // Submission is broken for good: the SQEs the kernel has not consumed stay unsubmitted forever (no
  // one enters the ring to submit again), so their pieces fail now; pieces already in the kernel are
  // still reaped, so no buffer is released under I/O.
  //
  // A failed piece's waiter may free its buffer at once, yet its SQE is still in the SQ, and any later
  // io_uring_submit (the shutdown wake-up, a retry after a transient error) would hand it to the kernel,
  // which would then write into freed memory and complete a slot whose piece is gone. So each such SQE
  // is rewritten in place as a NOP whose completion is ignored, before its piece is failed. The
  // unsubmitted SQEs are those from the kernel's head to liburing's local tail (sqe_tail, which also
  // covers SQEs not yet flushed to the shared tail); liburing 2.3 maps SQ slots to SQEs one to one.
  void fail_unsubmitted_locked(int err) noexcept {
    submit_err_ = err;
    try {
      submit_err_message_ = "submitting to io_uring failed: " + errno_text(err) +
                            ": the ring cannot take more work; recreate the engine or use backend='posix'";
    } catch (...) {
      // Out of memory: the requests still fail, with the errno and a shorter message.
    }
    const char* message = submit_err_message_.empty() ? "submitting to io_uring failed" : submit_err_message_.c_str();
    const unsigned mask = ring_.sq.ring_mask;
    const unsigned head = io_uring_smp_load_acquire(ring_.sq.khead);
    const unsigned tail = ring_.sq.sqe_tail;
    for (unsigned i = head; i != tail; ++i) {
      io_uring_sqe* sqe = &ring_.sq.sqes[i & mask];
      const uint64_t slot = sqe->user_data;
      if (slot == kStopTag || slot == kNeutralisedTag) continue;
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kNeutralisedTag);
      if (slot >= slots_.size() || !slots_[slot].req) continue;
      queue_.fail_noexcept(slots_[slot], err, message);
      release_locked(static_cast<uint32_t>(slot));
    }
    fail_retries_locked(err, message);
    try {
      queue_.fail_all_queued(err, submit_err_message_);
    } catch (...) {
      // fail_all_queued only allocates its local copy of the queue; the next submit or completion
      // tries again (submit_err_ is set).
    }
  }

  // Pieces waiting for a retry are in no SQE: once submission is broken they fail at once.
  void fail_retries_locked(int err, const char* message) noexcept {
    for (uint32_t slot : retry_) {
      if (!slots_[slot].req) continue;
      queue_.fail_noexcept(slots_[slot], err, message);
      release_locked(slot);
    }
    retry_.clear();
  }

  // Checks one completion. An exception here (an allocation failing while an error message is built,
  // or the test hook) fails the piece's request with ENOMEM instead of ending the thread: the kernel is
  // done with this piece, so failing it releases no buffer under I/O, and its waiter wakes.
  void complete_locked(uint32_t slot, int res) noexcept {
    if (!slots_[slot].req) return;  // never dereference a slot whose piece is gone
    try {
      testing::maybe_throw_in_completion();
      if (queue_.complete(slots_[slot], res)) {
        retry_.push_back(slot);  // capacity reserved: never allocates
        return;
      }
    } catch (...) {
      queue_.fail_noexcept(slots_[slot], ENOMEM, kCompletionThreadFailure);
    }
    release_locked(slot);
  }

  // Never returns while pieces are in the kernel: their buffers may still be written, so the thread
  // keeps reaping whatever fails around it (an exception outside the checking of one completion, in
  // refilling or submitting, is retried after a pause).
  void reap_loop() noexcept {
    int wait_errors = 0;
    for (;;) {
      try {
        if (reap_once(&wait_errors)) return;
      } catch (...) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
  }

  // One wait and one batch of completions; true when the backend is stopping and nothing is in flight.
  bool reap_once(int* wait_errors) {
    io_uring_cqe* cqe = nullptr;
    int ret;
    if (features_ & IORING_FEAT_EXT_ARG) {
      // With EXT_ARG the timeout travels in the syscall; without it liburing would queue a timeout
      // SQE from this thread, which would race the submitters on the SQ.
      // Wake for a batch: with many pieces in flight, waiting for an eighth of them to complete still
      // keeps the queue nearly full and divides wake-ups and refill syscalls by that much. The count
      // can only be too low (pieces only leave flight here), never strand the wait.
      const unsigned wait_nr = std::max(1u, in_kernel_.load(std::memory_order_relaxed) / 8);
      __kernel_timespec ts{1, 0};
      ret = io_uring_wait_cqes(&ring_, &cqe, wait_nr, &ts, nullptr);
    } else {
      ret = io_uring_wait_cqe(&ring_, &cqe);
    }
    if (ret < 0) {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ && in_flight_ == 0) return true;
      if (ret == -ETIME || ret == -EINTR || ret == -EAGAIN) return false;
      // Unexpected: keep trying (never release buffers the kernel may still write), slowly.
      if (++*wait_errors > 3) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      return false;
    }
    *wait_errors = 0;
    const unsigned n = io_uring_peek_batch_cqe(&ring_, cqes_.data(), static_cast<unsigned>(cqes_.size()));
    std::lock_guard<std::mutex> lock(mu_);
    for (unsigned i = 0; i < n; ++i) {
      const uint64_t tag = io_uring_cqe_get_data64(cqes_[i]);
      if (tag >= slots_.size()) continue;  // the stop NOP, a neutralised SQE
      complete_locked(static_cast<uint32_t>(tag), cqes_[i]->res);
    }
    io_uring_cq_advance(&ring_, n);
    if (!submit_err_) {
      fill_locked();
      submit_locked();
    } else {
      // Remainders of short transfers that completed after submission broke can never go out again.
      fail_retries_locked(submit_err_, submit_err_message_.c_str());
    }
    in_kernel_.store(in_flight_ - static_cast<unsigned>(retry_.size()), std::memory_order_relaxed);
    return stopping_ && in_flight_ == 0;
  }

  io_uring ring_{};
  unsigned features_ = 0;
  PieceQueue queue_;
  std::shared_ptr<PinnedPool> pool_;  // registered buffers must outlive the ring
  bool fixed_ = false;
  std::string fixed_note_, setup_note_;

  std::mutex mu_;
  std::vector<Piece> slots_;
  std::vector<uint32_t> free_;   // free slot indices
  std::vector<uint32_t> retry_;  // slots whose piece must be submitted again
  std::vector<io_uring_cqe*> cqes_;
  unsigned in_flight_ = 0;       // slots in use
  std::atomic<unsigned> in_kernel_{0};  // pieces submitted and not reaped: how many the reaper waits for
  bool stopping_ = false;
  int submit_err_ = 0;
  std::string submit_err_message_;
  std::thread reaper_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(const BackendOptions& options, const std::shared_ptr<PinnedPool>& pool,
                                            Counters* counters) {
  return std::make_unique<UringBackend>(options, pool, counters);
}

}  // namespace aidaptiv::detail

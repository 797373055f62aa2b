// A request (one buffer <-> one file range) and the pieces it is cut into for the backends.
//
// A request of n bytes is cut into block_size pieces over its 4 KiB-multiple body, which go through
// the O_DIRECT descriptor, and one last piece for the final n % 4096 bytes, which goes through the
// file's buffered descriptor from/to the same user buffer (so neighbouring bytes in the file are
// kept and the file size is exact; Linux keeps direct and buffered I/O of a file coherent).
//
// Locking: everything under "backend lock" is touched only with the owning backend's mutex held;
// waiters use the request's own mutex. Lock order: backend mutex, then request mutex.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>

#include "aidaptiv/detail/open_file.hpp"

namespace aidaptiv::detail {

enum class Op : uint8_t { Read, Write };

// The first error of a request, raised at wait.
struct RequestError {
  int err = 0;  // errno; ENODATA for end of file
  std::string path;
  std::string message;
};

// Counters of one engine, bumped as requests complete.
struct Counters {
  std::atomic<uint64_t> bytes_read{0}, bytes_written{0}, reads{0}, writes{0}, errors{0};
  std::atomic<uint64_t> wait_ns{0};
  // O_DIRECT pieces the kernel answered EINVAL and that were retried through the page cache (see
  // PieceQueue::complete): each is a silent slow path, so it is counted and reported.
  std::atomic<uint64_t> direct_fallbacks{0};
};

class Request {
 public:
  Request(Op op, std::shared_ptr<OpenFile> file, char* buf, uint64_t nbytes, uint64_t offset,
          std::shared_ptr<void> keepalive)
      : op(op), file(std::move(file)), buf(buf), nbytes(nbytes), offset(offset),
        body(nbytes / 4096 * 4096), keepalive_(std::move(keepalive)) {}

  const Op op;
  const std::shared_ptr<OpenFile> file;  // keeps the descriptors open until the request is gone
  char* const buf;
  const uint64_t nbytes;
  const uint64_t offset;
  const uint64_t body;  // bytes that go O_DIRECT; the rest (< 4096) goes buffered

  // Under the backend lock.
  uint64_t carved = 0;       // bytes already cut into pieces
  uint32_t outstanding = 0;  // pieces cut and not yet finished
  bool queued = false;       // in the backend's queue of requests with pieces left to cut
  bool failed = false;
  RequestError error;

  // Called once, when nothing of the request is in flight any more; wakes the waiter. The notify
  // happens under the lock and wait() always takes the lock, so a waiter that goes on to destroy the
  // request cannot do so while mark_done() still touches it.
  void mark_done() {
    std::lock_guard<std::mutex> lock(m_);
    done_.store(true, std::memory_order_release);
    cv_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [this] { return done(); });
  }
  bool done() const { return done_.load(std::memory_order_acquire); }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::shared_ptr<void> keepalive_;  // the tensor (or other owner) of buf
};

// One submission: a contiguous run of a request's bytes through one descriptor.
struct Piece {
  Request* req = nullptr;
  char* buf = nullptr;
  uint64_t offset = 0;
  uint64_t len = 0;
  bool buffered = false;  // through the buffered descriptor (the tail, or a fallback)
  int fixed_index = -1;   // io_uring registered-buffer index, -1 for a plain buffer
  uint32_t retries = 0;   // -EAGAIN / -EINTR / no-progress retries so far
  bool einval_retried = false;

  // Accounts for a short transfer of n bytes. A remainder that is no longer 4 KiB aligned cannot go
  // O_DIRECT (the kernel would answer EINVAL), so it moves to the buffered descriptor, which then
  // reports the real cause (end of file, file-size limit) or finishes the transfer.
  void advance(uint64_t n) {
    buf += n;
    offset += n;
    len -= n;
    if (!buffered && ((reinterpret_cast<uintptr_t>(buf) | offset | len) % 4096) != 0) buffered = true;
  }
  // The descriptor this piece goes through, or -errno.
  int fd() const { return buffered ? req->file->buffered_fd_noexcept() : req->file->direct_fd(); }
};

// Registered (fixed) buffers: [base, base + length) registered as consecutive chunk-sized iovecs.
struct FixedRegion {
  char* base = nullptr;
  uint64_t length = 0;
  uint64_t chunk = 1ull << 30;  // io_uring refuses registered buffers over 1 GiB
};

// The requests with pieces left to cut, and the rules for finishing and failing. Not thread-safe:
// callers hold their backend's lock.
//
// Reads are cut before writes. Someone is usually waiting for a read (a layer group about to run, the
// optimizer chunk to update next), while writes are write-behind that nobody waits for until memory is
// needed; in one FIFO a read issued after a burst of writes would wait for all of them to reach the disk.
class PieceQueue {
 public:
  PieceQueue(uint64_t block_size, Counters* counters) : block_size_(block_size), counters_(counters) {}
  void set_fixed_region(const FixedRegion& region) { fixed_ = region; }

  void push(Request* r);
  bool empty() const { return reads_.empty() && writes_.empty(); }
  // Cuts the next piece off the front request; false when nothing is left to cut.
  bool next(Piece* out);
  // A piece ended (fully done, or abandoned after its request failed).
  void finish(Piece& p);
  // A piece failed with errno err: keeps the request's first error, stops cutting it, finishes p.
  void fail(Piece& p, int err, const std::string& what_happened);
  // The same for a completion thread that caught an exception: finishes p even when building the
  // message runs out of memory (the request then fails with err and whatever message could be kept),
  // so that no waiter hangs. Does nothing when p is already finished (p.req is null).
  void fail_noexcept(Piece& p, int err, const char* what_happened) noexcept;
  // Applies one transfer result (bytes moved, or -errno) to p, checking it the way every completion
  // must be checked. Returns true when p must be submitted again (a short transfer's remainder, or a
  // retry); otherwise p is finished (or failed) and its slot may be reused.
  bool complete(Piece& p, int64_t res);
  // Fails every queued request that has nothing in flight (used when a backend cannot go on).
  void fail_all_queued(int err, const std::string& message);

  // "read of 1048576 bytes at offset 4096 from /x/y.swp"
  static std::string describe(const Piece& p);

 private:
  void maybe_complete(Request* r);
  // Records r's failure (errno only) and takes it out of the queue; the caller fills in the message.
  void mark_failed(Request* r, int err) noexcept;

  std::deque<Request*>& queue_of(const Request* r) { return r->op == Op::Read ? reads_ : writes_; }

  std::deque<Request*> reads_, writes_;
  uint64_t block_size_;
  Counters* counters_;
  FixedRegion fixed_;
};

}  // namespace aidaptiv::detail

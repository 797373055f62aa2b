// Engine: asynchronous reads and writes between host buffers and files, with O_DIRECT.
//
//   Engine engine({.backend = BackendKind::Auto}, pool);
//   int64_t f = engine.open("/nvme/swap/0.bin", /*create=*/true, /*exclusive=*/false);
//   uint64_t h = engine.write_async(tensor, f, 0);   // returns at once
//   engine.wait(h);                                  // bytes written, or throws the first error
//
// Buffers and file offsets must be 4 KiB aligned; lengths may be anything (the final partial block
// goes through a buffered descriptor of the same file). Every completion is checked; a request's first
// error is raised by wait() after all its pieces have drained, so a buffer is never released or reused
// while I/O on it is in flight.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <variant>

#include "aidaptiv/detail/backend.hpp"
#include "aidaptiv/pinned_pool.hpp"

namespace aidaptiv {

enum class BackendKind { IoUring, Posix, Auto };

struct EngineOptions {
  BackendKind backend = BackendKind::Auto;
  uint64_t block_size = 1ull << 20;  // bytes per piece; a multiple of 4 KiB
  unsigned queue_depth = 32;         // pieces in flight at most (io_uring)
  unsigned threads = 4;              // worker threads (POSIX backend)
  bool sqpoll = false;               // io_uring SQ polling thread (costs a core)
};

struct EngineStats {
  uint64_t bytes_read = 0, bytes_written = 0;
  uint64_t reads = 0, writes = 0;  // completed requests without error
  uint64_t errors = 0;             // failed requests
  uint64_t in_flight = 0;          // requests submitted and not yet collected by wait
  double wait_seconds = 0;         // time spent blocked in wait() and wait_all()
  uint64_t direct_fallbacks = 0;   // O_DIRECT pieces answered EINVAL and retried through the page cache
};

// A file given by the id open() returned, or by path (opened for this one request and closed when it
// completes: see Engine::resolve for why there is no descriptor cache keyed by path).
using FileRef = std::variant<int64_t, std::string>;

class Engine {
 public:
  // Throws SystemError when backend is IoUring and io_uring cannot start; Auto falls back to POSIX
  // and says why in fallback_reason().
  Engine(const EngineOptions& options, std::shared_ptr<PinnedPool> pool);
  ~Engine();  // waits for every request in flight
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t open(const std::string& path, bool create, bool exclusive);
  // Closing a file with requests in flight is safe: they keep its descriptors until they complete.
  void close(int64_t file_id);

  uint64_t read_async(const at::Tensor& buffer, const FileRef& file, int64_t offset);
  uint64_t write_async(const at::Tensor& buffer, const FileRef& file, int64_t offset);
  // Raw form for C++ callers (the CUDA pipeline): keepalive owns buf until the request is collected.
  uint64_t submit(detail::Op op, char* buf, uint64_t nbytes, const FileRef& file, int64_t offset,
                  std::shared_ptr<void> keepalive);

  // Waits for this request alone; returns the bytes transferred or throws its first error. The handle
  // is spent afterwards.
  uint64_t wait(uint64_t handle);
  // Whether the request has completed (wait() will not block); never blocks, never throws I/O errors.
  bool poll(uint64_t handle);
  // Waits for every request submitted so far and collects them all (their handles are spent); throws
  // the first error among them, by submission order, after all have drained.
  void wait_all();
  // Waits for everything in flight and stops the backend; later calls raise. Idempotent.
  void shutdown();

  EngineStats stats() const;
  BackendKind backend() const { return kind_; }
  std::string backend_name() const;
  const std::string& fallback_reason() const { return fallback_reason_; }
  bool fixed_buffers() const;
  std::string fixed_buffers_note() const;
  std::string setup_note() const;
  const EngineOptions& options() const { return options_; }
  const std::shared_ptr<PinnedPool>& pool() const { return pool_; }

#ifdef AIDAPTIV_WITH_CUDA
  // File -> pinned staging -> GPU, chunked so that reading chunk i+1 overlaps copying chunk i on a side
  // stream. staging is a pinned CPU tensor (from the pool) of at least 2 x 4 KiB; its halves alternate.
  // Blocks until the data is on the GPU; returns bytes moved.
  uint64_t read_to_device(const at::Tensor& dst, const FileRef& file, int64_t offset, const at::Tensor& staging);
  // GPU -> pinned staging -> file, the reverse pipeline.
  uint64_t write_from_device(const at::Tensor& src, const FileRef& file, int64_t offset,
                             const at::Tensor& staging);
#endif

 private:
  std::shared_ptr<detail::OpenFile> resolve(const FileRef& file, detail::Op op);
  // Checks the buffer and offset, then submits to f (or, when f is null, to *file, opened here).
  uint64_t submit_to(detail::Op op, char* buf, uint64_t nbytes, std::shared_ptr<detail::OpenFile> f,
                     int64_t offset, std::shared_ptr<void> keepalive, const FileRef* file = nullptr);
  std::shared_ptr<detail::Request> take(uint64_t handle);
  void check_open() const;

  EngineOptions options_;
  std::shared_ptr<PinnedPool> pool_;
  BackendKind kind_;
  std::string fallback_reason_;
  detail::Counters counters_;
  std::unique_ptr<detail::Backend> backend_;

  mutable std::mutex mu_;  // files_, requests_, next ids, closed_
  std::unordered_map<int64_t, std::shared_ptr<detail::OpenFile>> files_;
  std::unordered_map<uint64_t, std::shared_ptr<detail::Request>> requests_;
  int64_t next_file_ = 1;
  uint64_t next_handle_ = 1;
  bool closed_ = false;
};

}  // namespace aidaptiv

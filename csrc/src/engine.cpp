#include "aidaptiv/engine.hpp"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "aidaptiv/error.hpp"

namespace aidaptiv {

namespace {

detail::BackendOptions backend_options(const EngineOptions& o) {
  detail::BackendOptions b;
  b.block_size = o.block_size;
  b.queue_depth = o.queue_depth;
  b.threads = o.threads;
  b.sqpoll = o.sqpoll;
  return b;
}

void check_options(const EngineOptions& o) {
  AIDAPTIV_EXPECT(o.block_size >= kAlignment && o.block_size % kAlignment == 0 && o.block_size <= (1ull << 30),
                  "block_size " << o.block_size
                                << " is not a multiple of 4096 between 4096 and 1 GiB: O_DIRECT moves whole 4 KiB "
                                   "blocks; use e.g. 1048576");
  AIDAPTIV_EXPECT(o.queue_depth >= 1 && o.queue_depth <= 4096,
                  "queue_depth " << o.queue_depth << " is outside 1..4096: use e.g. 32");
  AIDAPTIV_EXPECT(o.threads >= 1 && o.threads <= 256, "threads " << o.threads << " is outside 1..256: use e.g. 4");
}

}  // namespace

Engine::Engine(const EngineOptions& options, std::shared_ptr<PinnedPool> pool)
    : options_(options), pool_(std::move(pool)), kind_(options.backend) {
  check_options(options_);
  if (options_.backend != BackendKind::Posix) {
    try {
      backend_ = detail::make_uring_backend(backend_options(options_), pool_, &counters_);
      kind_ = BackendKind::IoUring;
    } catch (const SystemError& e) {
      if (options_.backend == BackendKind::IoUring) throw;
      fallback_reason_ = std::string(e.what()) + "; backend 'auto' runs the POSIX thread pool instead";
    }
  }
  if (!backend_) {
    backend_ = detail::make_posix_backend(backend_options(options_), &counters_);
    kind_ = BackendKind::Posix;
  }
}

Engine::~Engine() {
  try {
    shutdown();
  } catch (...) {
    // shutdown() only throws on allocation failure; a destructor must not throw.
  }
}

std::string Engine::backend_name() const { return backend_->name(); }
bool Engine::fixed_buffers() const { return backend_->fixed_buffers(); }
std::string Engine::fixed_buffers_note() const { return backend_->fixed_buffers_note(); }
std::string Engine::setup_note() const { return backend_->setup_note(); }

void Engine::check_open() const {
  AIDAPTIV_EXPECT(!closed_, "I/O engine is closed: create a new IOEngine");
}

int64_t Engine::open(const std::string& path, bool create, bool exclusive) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
  }
  auto file = detail::OpenFile::open(path, detail::Access::ReadWrite, create, exclusive);
  std::lock_guard<std::mutex> lock(mu_);
  check_open();
  const int64_t id = next_file_++;
  files_[id] = std::move(file);
  return id;
}

void Engine::close(int64_t file_id) {
  std::lock_guard<std::mutex> lock(mu_);
  AIDAPTIV_EXPECT(files_.erase(file_id) == 1,
                  "file id " << file_id << " is not open in this engine: it was closed already or never opened here");
}

std::shared_ptr<detail::OpenFile> Engine::resolve(const FileRef& file, detail::Op op) {
  if (const int64_t* id = std::get_if<int64_t>(&file)) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = files_.find(*id);
    AIDAPTIV_EXPECT(it != files_.end(),
                    "file id " << *id << " is not open in this engine: open() it first (or it was closed)");
    return it->second;
  }
  // A path: open it for this request alone, closed when the request is collected. No descriptor cache
  // keyed by path, on purpose: a cached descriptor silently outlives an unlink or rename of its path
  // (DeepSpeed removes and recreates its swap folders, and reuses file names), so it could read or
  // write a stale inode; checking that with stat costs about as much as the open itself, which is a few
  // microseconds against the hundreds a 1 MiB transfer takes. Callers who want to keep a file open
  // use open()/close() and pass the id.
  const std::string& path = std::get<std::string>(file);
  if (op == detail::Op::Read) return detail::OpenFile::open(path, detail::Access::Read, false, false);
  return detail::OpenFile::open(path, detail::Access::Write, true, false);
}

uint64_t Engine::read_async(const at::Tensor& buffer, const FileRef& file, int64_t offset) {
  AIDAPTIV_EXPECT(buffer.defined() && buffer.device().is_cpu(),
                  "read buffer is on " << (buffer.defined() ? buffer.device().str() : std::string("nothing"))
                                       << ": expected a CPU tensor (use read_to_device for GPU tensors)");
  AIDAPTIV_EXPECT(buffer.is_contiguous(), "read buffer is not contiguous: expected a contiguous tensor");
  return submit(detail::Op::Read, static_cast<char*>(buffer.data_ptr()), buffer.nbytes(), file, offset,
                std::make_shared<at::Tensor>(buffer));
}

uint64_t Engine::write_async(const at::Tensor& buffer, const FileRef& file, int64_t offset) {
  AIDAPTIV_EXPECT(buffer.defined() && buffer.device().is_cpu(),
                  "write buffer is on " << (buffer.defined() ? buffer.device().str() : std::string("nothing"))
                                        << ": expected a CPU tensor (use write_from_device for GPU tensors)");
  AIDAPTIV_EXPECT(buffer.is_contiguous(), "write buffer is not contiguous: expected a contiguous tensor");
  return submit(detail::Op::Write, static_cast<char*>(buffer.data_ptr()), buffer.nbytes(), file, offset,
                std::make_shared<at::Tensor>(buffer));
}

uint64_t Engine::submit(detail::Op op, char* buf, uint64_t nbytes, const FileRef& file, int64_t offset,
                        std::shared_ptr<void> keepalive) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
  }
  // Arguments are checked before a path is opened (and a file perhaps created).
  return submit_to(op, buf, nbytes, nullptr, offset, std::move(keepalive), &file);
}

uint64_t Engine::submit_to(detail::Op op, char* buf, uint64_t nbytes, std::shared_ptr<detail::OpenFile> f,
                           int64_t offset, std::shared_ptr<void> keepalive, const FileRef* file) {
  const auto address = reinterpret_cast<uintptr_t>(buf);
  AIDAPTIV_EXPECT(address % kAlignment == 0,
                  "buffer address 0x" << std::hex << address << std::dec << " is not 4096-byte aligned (it is "
                                      << address % kAlignment
                                      << " bytes past a 4 KiB boundary): O_DIRECT needs 4 KiB aligned buffers; "
                                         "allocate them from a PinnedPool");
  AIDAPTIV_EXPECT(offset >= 0 && offset % static_cast<int64_t>(kAlignment) == 0,
                  "file offset " << offset << " is not a non-negative multiple of 4096: O_DIRECT needs 4 KiB "
                                 << "aligned file offsets");
  if (!f) f = resolve(*file, op);
  if (op == detail::Op::Write && !f->writable())
    throw SystemError(EBADF, f->path(),
                      "write to " + f->path() + " failed: the file is open read-only (it was not writable when "
                      "opened): fix its permissions and open it again");
  // Open the buffered descriptor for the tail now, in the caller's thread, so that failure is raised
  // here and the completion thread never has to open files on the hot path.
  if (nbytes % kAlignment) f->buffered_fd();
  if (op == detail::Op::Write && nbytes > 0) f->preallocate(static_cast<uint64_t>(offset), nbytes);

  auto req = std::make_shared<detail::Request>(op, std::move(f), buf, nbytes, static_cast<uint64_t>(offset),
                                               std::move(keepalive));
  uint64_t handle;
  {
    std::lock_guard<std::mutex> lock(mu_);
    check_open();
    handle = next_handle_++;
    requests_[handle] = req;
  }
  if (nbytes == 0)
    req->mark_done();
  else
    backend_->submit(req.get());
  return handle;
}

std::shared_ptr<detail::Request> Engine::take(uint64_t handle) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(handle);
  AIDAPTIV_EXPECT(it != requests_.end(), "I/O handle " << handle
                                                       << " is unknown: it was never returned by this engine or "
                                                          "was already waited for");
  return it->second;
}

uint64_t Engine::wait(uint64_t handle) {
  auto req = take(handle);
  const auto start = std::chrono::steady_clock::now();
  req->wait();
  counters_.wait_ns += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
  {
    std::lock_guard<std::mutex> lock(mu_);
    requests_.erase(handle);
  }
  if (req->failed) throw SystemError(req->error.err, req->error.path, req->error.message);
  return req->nbytes;
}

bool Engine::poll(uint64_t handle) { return take(handle)->done(); }

void Engine::wait_all() {
  std::vector<std::pair<uint64_t, std::shared_ptr<detail::Request>>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.assign(requests_.begin(), requests_.end());
  }
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const auto start = std::chrono::steady_clock::now();
  for (auto& [handle, req] : all) req->wait();
  counters_.wait_ns += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : all) requests_.erase(entry.first);
  }
  for (auto& [handle, req] : all)
    if (req->failed) throw SystemError(req->error.err, req->error.path, req->error.message);
}

void Engine::shutdown() {
  std::vector<std::shared_ptr<detail::Request>> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    for (auto& entry : requests_) all.push_back(entry.second);
  }
  // Results stay collectable with wait() after shutdown; only new work is refused.
  for (auto& req : all) req->wait();
  backend_->shutdown();
  std::lock_guard<std::mutex> lock(mu_);
  files_.clear();
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.bytes_read = counters_.bytes_read;
  s.bytes_written = counters_.bytes_written;
  s.reads = counters_.reads;
  s.writes = counters_.writes;
  s.errors = counters_.errors;
  s.direct_fallbacks = counters_.direct_fallbacks;
  s.wait_seconds = static_cast<double>(counters_.wait_ns.load()) * 1e-9;
  std::lock_guard<std::mutex> lock(mu_);
  s.in_flight = requests_.size();
  return s;
}

}  // namespace aidaptiv

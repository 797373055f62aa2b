#include "aidaptiv/pinned_pool.hpp"

#include <ATen/ATen.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>

#include "aidaptiv/detail/host_register.hpp"
#include "aidaptiv/error.hpp"

namespace aidaptiv {

namespace {

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

std::string memlock_limit_text() {
  struct rlimit lim;
  if (getrlimit(RLIMIT_MEMLOCK, &lim) != 0) return "unknown";
  if (lim.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(lim.rlim_cur / 1024) + " KiB";
}

constexpr uint64_t kHugePage = 2ull << 20;

// Faults in every page now, so that neither the first I/O nor the page-locking below pays for page faults
// later (what MAP_POPULATE did, which would fault 4 KiB pages before madvise could ask for huge ones).
// Returns 0, or the errno of a kernel that could not back the pool (ENOMEM): said as an error, where touching
// the pages would have called the OOM killer instead.
int prefault(char* base, uint64_t length) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(base, length, MADV_POPULATE_WRITE) == 0) return 0;
  if (errno != EINVAL) return errno;
#endif
  // Kernels before 5.14: touch one byte a page (anonymous memory reads as zero, so a zero keeps it).
  for (uint64_t off = 0; off < length; off += kAlignment) {
    reinterpret_cast<volatile char*>(base)[off] = 0;
  }
  return 0;
}

}  // namespace

std::shared_ptr<PinnedPool> PinnedPool::create(uint64_t capacity_bytes) {
  // make_shared cannot reach the private constructor.
  return std::shared_ptr<PinnedPool>(new PinnedPool(capacity_bytes));
}

PinnedPool::PinnedPool(uint64_t capacity_bytes) {
  AIDAPTIV_EXPECT(capacity_bytes > 0, "PinnedPool capacity_bytes is 0: give the pool's size in bytes (> 0)");
  capacity_ = round_up(capacity_bytes, kAlignment);
  // The pool starts on a 2 MiB boundary and asks for transparent huge pages. A huge page is 2 MiB of
  // physically contiguous memory, so a 1 MiB piece of I/O is one DMA segment; in 4 KiB pages it is up to 256,
  // and a disk that takes fewer a request (virtio-blk here: 254) splits every piece in two. The mapping is
  // made 2 MiB larger than the pool and trimmed to the aligned part.
  const uint64_t map_len = capacity_ + kHugePage;
  void* p = mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw SystemError(err, "",
                      "allocating a pinned pool of " + std::to_string(capacity_) + " bytes failed: " +
                          errno_text(err) + ": free host memory or ask for a smaller pool");
  }
  char* raw = static_cast<char*>(p);
  base_ = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(raw), kHugePage));
  if (base_ > raw) munmap(raw, base_ - raw);
  if (raw + map_len > base_ + capacity_) munmap(base_ + capacity_, raw + map_len - (base_ + capacity_));
  // Best effort: with transparent huge pages off ("never") the pool is in 4 KiB pages as before.
  madvise(base_, capacity_, MADV_HUGEPAGE);
  if (const int err = prefault(base_, capacity_)) {
    munmap(base_, capacity_);
    base_ = nullptr;
    throw SystemError(err, "",
                      "allocating a pinned pool of " + std::to_string(capacity_) + " bytes failed: " +
                          errno_text(err) + ": free host memory or ask for a smaller pool");
  }
  free_[0] = capacity_;

  std::string cuda_note;
  if (detail::cuda_host_register(base_, capacity_, &cuda_note)) {
    locked_ = true;
    lock_method_ = "cudaHostRegister";
  } else if (mlock(base_, capacity_) == 0) {
    locked_ = true;
    lock_method_ = "mlock";
  } else {
    const int err = errno;
    lock_note_ = "page-locking the pinned pool of " + std::to_string(capacity_) + " bytes failed: " +
                 errno_text(err) + (cuda_note.empty() ? "" : " (CUDA: " + cuda_note + ")") +
                 ": the pool works unlocked, but host<->GPU copies are slower and pages may be swapped "
                 "out; raise the locked-memory limit (ulimit -l, now " +
                 memlock_limit_text() + ") to at least the pool size";
  }
}

PinnedPool::~PinnedPool() {
  if (lock_method_ == "cudaHostRegister") {
    detail::cuda_host_unregister(base_);
  }
  // munmap also drops an mlock.
  if (base_) munmap(base_, capacity_);
}

void* PinnedPool::try_allocate_bytes(uint64_t nbytes, bool from_top, uint64_t* largest) noexcept {
  const uint64_t want = round_up(nbytes == 0 ? 1 : nbytes, kAlignment);
  std::lock_guard<std::mutex> lock(mu_);
  // Two ends, so that buffers of different kinds do not interleave: the low end takes the lowest block
  // that fits (first fit over the free list, kept coalesced and ordered by offset), the high end the
  // highest block that fits, cut from its end.
  *largest = 0;
  auto pick = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second > *largest) *largest = it->second;
    if (it->second < want) continue;
    if (from_top || pick == free_.end()) pick = it;
  }
  if (pick == free_.end()) return nullptr;
  const uint64_t block = pick->first;
  const uint64_t rest = pick->second - want;
  const uint64_t offset = from_top ? block + rest : block;
  free_.erase(pick);
  if (rest) free_[from_top ? block : block + want] = rest;
  used_[offset] = want;
  in_use_ += want;
  if (in_use_ > high_water_) high_water_ = in_use_;
  return base_ + offset;
}

void* PinnedPool::allocate_bytes(uint64_t nbytes, bool from_top) {
  uint64_t largest = 0;
  if (void* p = try_allocate_bytes(nbytes, from_top, &largest)) return p;
  const PoolStats s = stats();
  std::ostringstream msg;
  msg << "pinned pool cannot hand out " << round_up(nbytes == 0 ? 1 : nbytes, kAlignment) << " bytes: "
      << s.in_use << " of its " << capacity_ << " bytes are in use and the largest free block is " << largest
      << " bytes; free tensors taken from this pool or create a larger PinnedPool";
  throw OutOfPinnedMemory(msg.str());
}

void PinnedPool::release(void* ptr) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t offset = static_cast<uint64_t>(static_cast<char*>(ptr) - base_);
  auto used = used_.find(offset);
  if (used == used_.end()) return;  // not ours: nothing to give back (cannot happen via allocate)
  uint64_t start = offset, length = used->second;
  in_use_ -= length;
  used_.erase(used);
  // Coalesce with the neighbours on both sides.
  auto next = free_.lower_bound(start);
  if (next != free_.end() && start + length == next->first) {
    length += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == start) {
      start = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_[start] = length;
}

at::Tensor PinnedPool::wrap(void* ptr, int64_t numel, at::ScalarType dtype) {
  // The deleter keeps the pool alive until the last tensor from it is gone, and returns the block.
  auto self = shared_from_this();
  return at::from_blob(
      ptr, {numel}, [self](void* p) { self->release(p); }, at::TensorOptions().dtype(dtype).device(at::kCPU));
}

at::Tensor PinnedPool::allocate(int64_t numel, at::ScalarType dtype, bool from_top) {
  AIDAPTIV_EXPECT(numel >= 0, "PinnedPool.allocate numel is " << numel << ": expected a count >= 0");
  return wrap(allocate_bytes(static_cast<uint64_t>(numel) * c10::elementSize(dtype), from_top), numel, dtype);
}

std::optional<at::Tensor> PinnedPool::try_allocate(int64_t numel, at::ScalarType dtype, bool from_top) {
  AIDAPTIV_EXPECT(numel >= 0, "PinnedPool.try_allocate numel is " << numel << ": expected a count >= 0");
  uint64_t largest = 0;
  void* ptr = try_allocate_bytes(static_cast<uint64_t>(numel) * c10::elementSize(dtype), from_top, &largest);
  if (ptr == nullptr) return std::nullopt;
  return wrap(ptr, numel, dtype);
}

bool PinnedPool::contains(uintptr_t address, uint64_t nbytes) const {
  const auto base = reinterpret_cast<uintptr_t>(base_);
  return address >= base && nbytes <= capacity_ && address - base <= capacity_ - nbytes;
}

PoolStats PinnedPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  PoolStats s;
  s.capacity = capacity_;
  s.in_use = in_use_;
  s.high_water = high_water_;
  s.blocks = used_.size();
  for (const auto& [offset, length] : free_) s.largest_free = std::max(s.largest_free, length);
  s.locked = locked_;
  s.lock_method = lock_method_;
  s.lock_note = lock_note_;
  return s;
}

}  // namespace aidaptiv

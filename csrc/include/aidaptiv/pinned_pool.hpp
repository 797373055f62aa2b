// PinnedPool: one page-locked host allocation that hands out 4 KiB-aligned tensors.
//
// Why one allocation: io_uring can register it once as fixed buffers (no per-I/O page pinning),
// page-locking happens once, and the byte budget is a hard ceiling rather than a hope. Views are
// returned as torch tensors whose deleter gives the block back; each deleter holds a shared_ptr to
// the pool, so the memory outlives every tensor cut from it, whoever drops the pool first.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace aidaptiv {

constexpr uint64_t kAlignment = 4096;  // O_DIRECT buffer, offset and block alignment

struct PoolStats {
  uint64_t largest_free = 0;  // bytes of the largest free block (what one allocation can get now)
  uint64_t capacity = 0;    // bytes in the allocation
  uint64_t in_use = 0;      // bytes handed out now (4 KiB granules)
  uint64_t high_water = 0;  // most bytes ever handed out at once
  uint64_t blocks = 0;      // blocks handed out now
  bool locked = false;      // page-locked (mlock or cudaHostRegister)
  std::string lock_method;  // "cudaHostRegister", "mlock" or "none"
  std::string lock_note;    // why it is not locked, with what to do; empty when locked
};

class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  // Maps, pre-faults and page-locks capacity_bytes (rounded up to 4 KiB). Locking is best effort:
  // without it the pool still works, only slower for GPU copies; lock_note says why.
  static std::shared_ptr<PinnedPool> create(uint64_t capacity_bytes);
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A 1-D tensor of numel elements of dtype, 4 KiB aligned; throws OutOfPinnedMemory past the budget.
  // from_top: carve the block from the high end of the pool. Callers keep long-lived large buffers at
  // the low end and everything else at the high end, so short-lived buffers do not cut up the space the
  // large ones need (the pool cannot move live buffers to defragment).
  at::Tensor allocate(int64_t numel, at::ScalarType dtype, bool from_top = false);
  // The same, or nothing when no free block fits. A full pool is routine for the swapper (it reclaims and
  // asks again), so that path throws no C++ exception: an H100 training process died of SIGSEGV at its
  // first OutOfPinnedMemory (bench/results/gpu_probe/h100), and exceptions are slow besides.
  std::optional<at::Tensor> try_allocate(int64_t numel, at::ScalarType dtype, bool from_top = false);
  // Whether [address, address + nbytes) lies inside this pool's allocation.
  bool contains(uintptr_t address, uint64_t nbytes) const;
  PoolStats stats() const;

  char* base() const { return base_; }
  uint64_t capacity() const { return capacity_; }

 private:
  explicit PinnedPool(uint64_t capacity_bytes);
  void* allocate_bytes(uint64_t nbytes, bool from_top);
  // nullptr when no free block fits; *largest gets the largest free block then (for the message).
  void* try_allocate_bytes(uint64_t nbytes, bool from_top, uint64_t* largest) noexcept;
  at::Tensor wrap(void* ptr, int64_t numel, at::ScalarType dtype);
  void release(void* ptr) noexcept;

  char* base_ = nullptr;
  uint64_t capacity_ = 0;
  bool locked_ = false;
  std::string lock_method_ = "none";
  std::string lock_note_;

  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;            // offset -> length, coalesced on release
  std::unordered_map<uint64_t, uint64_t> used_;  // offset -> length
  uint64_t in_use_ = 0;
  uint64_t high_water_ = 0;
};

}  // namespace aidaptiv

// NVMe <-> pinned staging <-> GPU, pipelined (built only with AIDAPTIV_WITH_CUDA).
//
// read_to_device: the transfer is cut into chunks of half the staging buffer; while chunk i is copied
// host -> GPU on a side stream from one half, chunk i+1 is read from the file into the other half. A half
// is reused only after the copy out of it has completed (its event). write_from_device is the mirror:
// while chunk i is written to the file from one half, chunk i+1 is copied GPU -> host into the other.
// The side stream first waits for the work already queued on the caller's current stream (the tensor may
// be produced or consumed there); both functions return once everything has completed. On an error,
// whatever is in flight (file I/O into the staging buffer, copies) is drained before the error is raised.
#ifdef AIDAPTIV_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <optional>

#include "aidaptiv/engine.hpp"
#include "aidaptiv/error.hpp"

namespace aidaptiv {

namespace {

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw Error(std::string(what) + " failed: " + cudaGetErrorString(err) +
                ": check the GPU (nvidia-smi) and that the tensor lives on it");
}

// A side stream and one event per staging half; the destructor waits for the stream (so the staging
// buffer is never released with a copy in flight) and frees them.
class CopyStream {
 public:
  explicit CopyStream(cudaStream_t after) {
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    for (auto& e : done_) check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventRecord(ready_, after), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
  }
  ~CopyStream() {
    if (stream_) cudaStreamSynchronize(stream_);
    for (auto& e : done_)
      if (e) cudaEventDestroy(e);
    if (ready_) cudaEventDestroy(ready_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  void copy(void* dst, const void* src, uint64_t n, cudaMemcpyKind kind, int half) {
    check_cuda(cudaMemcpyAsync(dst, src, n, kind, stream_), "cudaMemcpyAsync");
    check_cuda(cudaEventRecord(done_[half], stream_), "cudaEventRecord");
  }
  void wait_copy(int half) { check_cuda(cudaEventSynchronize(done_[half]), "cudaEventSynchronize"); }
  void finish() { check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_[2] = {nullptr, nullptr};
  cudaEvent_t ready_ = nullptr;
};

uint64_t staging_half(const at::Tensor& staging) {
  AIDAPTIV_EXPECT(staging.device().is_cpu() && staging.is_contiguous(),
                  "staging must be a contiguous CPU tensor (take it from the PinnedPool)");
  AIDAPTIV_EXPECT(reinterpret_cast<uintptr_t>(staging.data_ptr()) % kAlignment == 0,
                  "staging is not 4096-byte aligned: take it from the PinnedPool");
  const uint64_t half = staging.nbytes() / 2 / kAlignment * kAlignment;
  AIDAPTIV_EXPECT(half >= kAlignment, "staging has " << staging.nbytes()
                                                     << " bytes: it needs at least 8192 (two 4 KiB halves)");
  return half;
}

}  // namespace

uint64_t Engine::read_to_device(const at::Tensor& dst, const FileRef& file, int64_t offset,
                                const at::Tensor& staging) {
  AIDAPTIV_EXPECT(dst.is_cuda() && dst.is_contiguous(),
                  "read_to_device needs a contiguous CUDA tensor, got one on " << dst.device().str());
  const uint64_t half = staging_half(staging);
  const uint64_t total = dst.nbytes();
  if (total == 0) return 0;
  auto f = resolve(file, detail::Op::Read);
  c10::cuda::CUDAGuard guard(dst.device());
  char* halves[2] = {static_cast<char*>(staging.data_ptr()), static_cast<char*>(staging.data_ptr()) + half};
  char* out = static_cast<char*>(dst.data_ptr());
  const uint64_t chunks = (total + half - 1) / half;
  auto length = [&](uint64_t i) { return std::min(half, total - i * half); };
  auto read = [&](uint64_t i) {
    return submit_to(detail::Op::Read, halves[i % 2], length(i), f, offset + static_cast<int64_t>(i * half), nullptr);
  };

  std::optional<uint64_t> pending;
  CopyStream copies(c10::cuda::getCurrentCUDAStream(dst.device().index()).stream());
  try {
    pending = read(0);
    for (uint64_t i = 0; i < chunks; ++i) {
      const uint64_t h = *pending;
      pending.reset();
      wait(h);  // chunk i is in halves[i % 2]
      if (i + 1 < chunks) {
        if (i >= 1) copies.wait_copy(static_cast<int>((i + 1) % 2));  // chunk i-1 has left that half
        pending = read(i + 1);
      }
      copies.copy(out + i * half, halves[i % 2], length(i), cudaMemcpyHostToDevice, static_cast<int>(i % 2));
    }
    copies.finish();
  } catch (...) {
    if (pending) {
      try {
        wait(*pending);
      } catch (...) {  // the first error is the one to report
      }
    }
    throw;
  }
  return total;
}

uint64_t Engine::write_from_device(const at::Tensor& src, const FileRef& file, int64_t offset,
                                   const at::Tensor& staging) {
  AIDAPTIV_EXPECT(src.is_cuda() && src.is_contiguous(),
                  "write_from_device needs a contiguous CUDA tensor, got one on " << src.device().str());
  const uint64_t half = staging_half(staging);
  const uint64_t total = src.nbytes();
  if (total == 0) return 0;
  auto f = resolve(file, detail::Op::Write);
  c10::cuda::CUDAGuard guard(src.device());
  char* halves[2] = {static_cast<char*>(staging.data_ptr()), static_cast<char*>(staging.data_ptr()) + half};
  const char* in = static_cast<const char*>(src.data_ptr());
  const uint64_t chunks = (total + half - 1) / half;
  auto length = [&](uint64_t i) { return std::min(half, total - i * half); };

  std::optional<uint64_t> pending;
  CopyStream copies(c10::cuda::getCurrentCUDAStream(src.device().index()).stream());
  try {
    copies.copy(halves[0], in, length(0), cudaMemcpyDeviceToHost, 0);
    for (uint64_t i = 0; i < chunks; ++i) {
      copies.wait_copy(static_cast<int>(i % 2));  // chunk i is in halves[i % 2]
      if (pending) {  // the write of chunk i-1 must leave the other half before chunk i+1 goes there
        const uint64_t h = *pending;
        pending.reset();
        wait(h);
      }
      if (i + 1 < chunks)
        copies.copy(halves[(i + 1) % 2], in + (i + 1) * half, length(i + 1), cudaMemcpyDeviceToHost,
                    static_cast<int>((i + 1) % 2));
      pending = submit_to(detail::Op::Write, halves[i % 2], length(i), f, offset + static_cast<int64_t>(i * half),
                          nullptr);
    }
    const uint64_t h = *pending;
    pending.reset();
    wait(h);
  } catch (...) {
    if (pending) {
      try {
        wait(*pending);
      } catch (...) {
      }
    }
    throw;  // ~CopyStream waits for any copy still in flight
  }
  return total;
}

}  // namespace aidaptiv
#endif

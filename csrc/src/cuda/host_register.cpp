// Page-locking through CUDA (built only with AIDAPTIV_WITH_CUDA): memory registered with
// cudaHostRegister is pinned for DMA, so host<->GPU copies from the pool run at full PCIe speed and can be
// asynchronous. Without a device we answer "no" and the pool uses mlock.
#ifdef AIDAPTIV_WITH_CUDA
#include <cuda_runtime_api.h>

#include "aidaptiv/detail/host_register.hpp"

namespace aidaptiv::detail {

bool cuda_host_register(void* ptr, size_t nbytes, std::string* note) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();  // clear the sticky-free error so later CUDA calls do not see it
    note->clear();
    return false;
  }
  // Portable: pinned for every CUDA context of the process, not only the current device's.
  const cudaError_t err = cudaHostRegister(ptr, nbytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    *note = std::string("cudaHostRegister: ") + cudaGetErrorString(err);
    cudaGetLastError();
    return false;
  }
  return true;
}

void cuda_host_unregister(void* ptr) {
  // Copies from or into the pool may still be in flight on any stream (a non_blocking copy of a slot, one of
  // DeepSpeed's prefetches): wait for the device before the pages are unregistered and then unmapped. At
  // interpreter exit the CUDA runtime may be gone already; nothing to do about an error then.
  if (cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
  if (cudaHostUnregister(ptr) != cudaSuccess) cudaGetLastError();
}

}  // namespace aidaptiv::detail
#endif

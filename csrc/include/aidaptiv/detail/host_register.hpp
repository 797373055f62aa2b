// Page-locking of host memory for the pinned pool: cudaHostRegister when built with CUDA and a device
// is present (so host<->GPU copies are true DMA), mlock otherwise.
#pragma once

#include <cstddef>
#include <string>

namespace aidaptiv::detail {

// Tries to register [ptr, ptr + nbytes) with CUDA. Returns true on success. Returns false, leaving
// why in *note when CUDA is present but refused, and false with an empty note when there is no CUDA.
bool cuda_host_register(void* ptr, size_t nbytes, std::string* note);
void cuda_host_unregister(void* ptr);

}  // namespace aidaptiv::detail

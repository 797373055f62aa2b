// Without CUDA there is nothing to register with: the pool falls back to mlock.
#ifndef AIDAPTIV_WITH_CUDA
#include "aidaptiv/detail/host_register.hpp"

namespace aidaptiv::detail {

bool cuda_host_register(void*, size_t, std::string* note) {
  note->clear();
  return false;
}

void cuda_host_unregister(void*) {}

}  // namespace aidaptiv::detail
#endif

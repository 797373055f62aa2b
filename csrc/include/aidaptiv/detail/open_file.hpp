// An open swap file: its O_DIRECT descriptor and, opened on first need, a buffered descriptor of the
// same file for the final partial block of a request (O_DIRECT moves whole 4 KiB blocks only).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

namespace aidaptiv::detail {

enum class Access { Read, Write, ReadWrite };

class OpenFile {
 public:
  // Opens path with O_DIRECT | O_CLOEXEC | O_NOFOLLOW; mode 0600 when created, O_EXCL when exclusive.
  // An existing file must belong to this process's effective uid (PermissionError otherwise): the
  // swap space holds private weights, and we never write into another user's file.
  // ReadWrite falls back to read-only when the file is not writable and create is false.
  static std::shared_ptr<OpenFile> open(const std::string& path, Access access, bool create, bool exclusive);
  ~OpenFile();
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;

  const std::string& path() const { return path_; }
  int direct_fd() const { return direct_fd_; }
  bool readable() const { return readable_; }
  bool writable() const { return writable_; }
  // The buffered descriptor, opened on first call (thread-safe); throws SystemError when it cannot be.
  int buffered_fd();
  // Best effort: when [offset, offset + len) reaches past the end of the file, allocates it first
  // (fallocate). See the definition for why; failures are ignored (the write reports the real error).
  void preallocate(uint64_t offset, uint64_t len) noexcept;
  // Like buffered_fd() but returns -errno instead of throwing (for the completion thread).
  int buffered_fd_noexcept() noexcept;

 private:
  OpenFile(std::string path, int fd, int flags, bool readable, bool writable);

  std::string path_;
  int direct_fd_;
  int flags_;  // the open(2) flags of direct_fd_, reused (less O_DIRECT) for the buffered descriptor
  bool readable_;
  bool writable_;
  std::mutex mu_;
  std::atomic<int> buffered_fd_{-1};
};

}  // namespace aidaptiv::detail

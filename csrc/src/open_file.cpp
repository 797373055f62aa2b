#include "aidaptiv/detail/open_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aidaptiv/error.hpp"

namespace aidaptiv::detail {

namespace {

const char* verb(Access access) {
  switch (access) {
    case Access::Read:
      return "reading";
    case Access::Write:
      return "writing";
    default:
      return "reading and writing";
  }
}

}  // namespace

std::shared_ptr<OpenFile> OpenFile::open(const std::string& path, Access access, bool create, bool exclusive) {
  AIDAPTIV_EXPECT(!path.empty(), "swap file path is empty: give the path of a file");
  AIDAPTIV_EXPECT(!exclusive || create, "exclusive=True needs create=True for " << path
                                            << ": exclusive means 'create it, and fail if it exists'");
  AIDAPTIV_EXPECT(!(create && access == Access::Read), "create=True with read-only access for " << path);
  int base = O_DIRECT | O_CLOEXEC | O_NOFOLLOW;
  if (create) base |= O_CREAT;
  if (exclusive) base |= O_EXCL;
  int mode_flags = access == Access::Read ? O_RDONLY : access == Access::Write ? O_WRONLY : O_RDWR;
  bool readable = access != Access::Write, writable = access != Access::Read;

  int fd = ::open(path.c_str(), base | mode_flags, 0600);
  if (fd == -1 && access == Access::ReadWrite && !create && (errno == EACCES || errno == EROFS)) {
    // Reading a file we may not write (a read-only filesystem or file) is still useful.
    mode_flags = O_RDONLY;
    writable = false;
    fd = ::open(path.c_str(), base | mode_flags, 0600);
  }
  AIDAPTIV_CHECK_SYSCALL(fd, path, "opening swap file " << path << " for " << verb(access) << " with O_DIRECT");

  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw_system_error(err, path, "stat of swap file " + path);
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    throw_system_error(EISDIR, path, "opening swap file " + path);
  }
  if (st.st_uid != geteuid()) {
    ::close(fd);
    throw SystemError(EPERM, path,
                      "opening swap file " + path + " refused: it belongs to uid " + std::to_string(st.st_uid) +
                          ", not to this process's uid " + std::to_string(geteuid()) +
                          "; swap files are never shared with another user: remove it or choose another path");
  }
  return std::shared_ptr<OpenFile>(new OpenFile(path, fd, base | mode_flags, readable, writable));
}

OpenFile::OpenFile(std::string path, int fd, int flags, bool readable, bool writable)
    : path_(std::move(path)), direct_fd_(fd), flags_(flags), readable_(readable), writable_(writable) {}

OpenFile::~OpenFile() {
  if (direct_fd_ >= 0) ::close(direct_fd_);
  const int b = buffered_fd_.load();
  if (b >= 0) ::close(b);
}

int OpenFile::buffered_fd_noexcept() noexcept {
  int fd = buffered_fd_.load(std::memory_order_acquire);
  if (fd >= 0) return fd;
  std::lock_guard<std::mutex> lock(mu_);
  fd = buffered_fd_.load(std::memory_order_relaxed);
  if (fd >= 0) return fd;
  // Reopen the very same file through /proc/self/fd, without O_DIRECT: the path may have been renamed
  // or replaced since we opened it. O_NOFOLLOW must go (the /proc entry is a link by design), and so
  // must O_CREAT/O_EXCL (the file exists: it is ours).
  const int flags = flags_ & ~(O_DIRECT | O_NOFOLLOW | O_CREAT | O_EXCL);
  const std::string proc = "/proc/self/fd/" + std::to_string(direct_fd_);
  fd = ::open(proc.c_str(), flags);
  if (fd == -1) {
    // No /proc: reopen by path, and make sure it is still the same inode.
    fd = ::open(path_.c_str(), flags | O_NOFOLLOW);
    if (fd == -1) return -errno;
    struct stat a, b;
    if (fstat(fd, &a) != 0 || fstat(direct_fd_, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev) {
      ::close(fd);
      return -ESTALE;
    }
  }
  buffered_fd_.store(fd, std::memory_order_release);
  return fd;
}

void OpenFile::preallocate(uint64_t offset, uint64_t len) noexcept {
  // An O_DIRECT write that extends a file, or fills a hole, needs the inode lock exclusively on ext4
  // (and similar filesystems), so the kernel cannot start it without blocking: io_uring answers -EAGAIN
  // inside and hands the write to an io-wq worker, which serializes writes per file and was measured
  // burning about 0.4 CPU s/GB spinning on that lock at queue depth 32. Allocating the range first
  // (which also sets the file size) turns every piece into an overwrite of allocated blocks, which runs
  // under the shared lock without blocking, submitted inline like a read. fio does the same by default.
  // Errors (EOPNOTSUPP, ENOSPC, EFBIG, ...) are ignored: the write itself then reports the real one.
  struct stat st;
  if (fstat(direct_fd_, &st) != 0 || !S_ISREG(st.st_mode)) return;
  if (static_cast<uint64_t>(st.st_size) >= offset + len) return;
  (void)fallocate(direct_fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(len));
}

int OpenFile::buffered_fd() {
  const int fd = buffered_fd_noexcept();
  if (fd < 0) throw_system_error(-fd, path_, "opening a buffered descriptor of swap file " + path_);
  return fd;
}

}  // namespace aidaptiv::detail

#include "aidaptiv/error.hpp"

#include <cstring>

namespace aidaptiv {

std::string errno_text(int err) {
  // strerrorname_np is glibc >= 2.32; it returns NULL for unknown codes.
  const char* name = strerrorname_np(err);
  std::string text = name ? name : ("errno " + std::to_string(err));
  return text + " (" + std::strerror(err) + ")";
}

std::string errno_advice(int err) {
  switch (err) {
    case ENOENT:
      return "the file or its directory does not exist; create the directory first or fix the path";
    case EACCES:
    case EPERM:
      return "permission denied; choose a directory you own or fix its permissions";
    case EROFS:
      return "the filesystem is read-only; choose a writable directory";
    case ENOSPC:
      return "the disk is full; free space or choose a disk with room for the swap files";
    case EDQUOT:
      return "the disk quota is exhausted; free space or raise the quota";
    case EFBIG:
      return "the file would exceed the file-size limit (ulimit -f) or the filesystem's largest file; "
             "raise the limit or use smaller files";
    case EIO:
      return "the device reported an error; check dmesg and the disk";
    case EINVAL:
      return "the filesystem refused O_DIRECT or the request's alignment; use a filesystem that "
             "supports O_DIRECT (not tmpfs) with 4 KiB aligned buffers and offsets";
    case ELOOP:
      return "the path is a symbolic link, which swap files refuse to follow (O_NOFOLLOW); "
             "point the path at a real file";
    case EEXIST:
      return "the file already exists and exclusive creation was asked; remove it or open it "
             "without exclusive";
    case EISDIR:
      return "the path is a directory; give a file path";
    case ENOTDIR:
      return "a component of the path is not a directory; fix the path";
    case EBADF:
      return "the file is not open for this kind of access (opened read-only?); open it writable";
    case EMFILE:
    case ENFILE:
      return "too many open files; close files or raise the limit (ulimit -n)";
    case ENOMEM:
      return "the kernel is out of memory; free memory or lower the queue depth";
    case ENAMETOOLONG:
      return "the path is too long; use a shorter path";
    default:
      return "check the path, its filesystem and the disk";
  }
}

void throw_system_error(int err, const std::string& path, const std::string& action) {
  throw SystemError(err, path, action + " failed: " + errno_text(err) + ": " + errno_advice(err));
}

}  // namespace aidaptiv

#include "aidaptiv/error.hpp"

#include <cstring>

// strerrorname_np appeared in glibc 2.32; older glibc (and other C libraries) get the table below.
// AIDAPTIV_NO_STRERRORNAME_NP selects the table anyway (tests/build compiles it that way).
#if defined(__GLIBC__) && defined(__GLIBC_PREREQ) && !defined(AIDAPTIV_NO_STRERRORNAME_NP)
#if __GLIBC_PREREQ(2, 32)
#define AIDAPTIV_HAVE_STRERRORNAME_NP 1
#endif
#endif

namespace aidaptiv {

namespace {

#ifdef AIDAPTIV_HAVE_STRERRORNAME_NP
const char* errno_name(int err) { return strerrorname_np(err); }  // NULL for unknown codes
#else
// The codes file I/O, io_uring and memory locking can answer; others print as "errno N".
const char* errno_name(int err) {
  switch (err) {
#define AIDAPTIV_ERRNO_NAME(code) \
  case code:                      \
    return #code;
    AIDAPTIV_ERRNO_NAME(EPERM)
    AIDAPTIV_ERRNO_NAME(ENOENT)
    AIDAPTIV_ERRNO_NAME(ESRCH)
    AIDAPTIV_ERRNO_NAME(EINTR)
    AIDAPTIV_ERRNO_NAME(EIO)
    AIDAPTIV_ERRNO_NAME(ENXIO)
    AIDAPTIV_ERRNO_NAME(E2BIG)
    AIDAPTIV_ERRNO_NAME(EBADF)
    AIDAPTIV_ERRNO_NAME(EAGAIN)
    AIDAPTIV_ERRNO_NAME(ENOMEM)
    AIDAPTIV_ERRNO_NAME(EACCES)
    AIDAPTIV_ERRNO_NAME(EFAULT)
    AIDAPTIV_ERRNO_NAME(EBUSY)
    AIDAPTIV_ERRNO_NAME(EEXIST)
    AIDAPTIV_ERRNO_NAME(EXDEV)
    AIDAPTIV_ERRNO_NAME(ENODEV)
    AIDAPTIV_ERRNO_NAME(ENOTDIR)
    AIDAPTIV_ERRNO_NAME(EISDIR)
    AIDAPTIV_ERRNO_NAME(EINVAL)
    AIDAPTIV_ERRNO_NAME(ENFILE)
    AIDAPTIV_ERRNO_NAME(EMFILE)
    AIDAPTIV_ERRNO_NAME(ETXTBSY)
    AIDAPTIV_ERRNO_NAME(EFBIG)
    AIDAPTIV_ERRNO_NAME(ENOSPC)
    AIDAPTIV_ERRNO_NAME(ESPIPE)
    AIDAPTIV_ERRNO_NAME(EROFS)
    AIDAPTIV_ERRNO_NAME(EMLINK)
    AIDAPTIV_ERRNO_NAME(EPIPE)
    AIDAPTIV_ERRNO_NAME(ERANGE)
    AIDAPTIV_ERRNO_NAME(EDEADLK)
    AIDAPTIV_ERRNO_NAME(ENAMETOOLONG)
    AIDAPTIV_ERRNO_NAME(ENOLCK)
    AIDAPTIV_ERRNO_NAME(ENOSYS)
    AIDAPTIV_ERRNO_NAME(ENOTEMPTY)
    AIDAPTIV_ERRNO_NAME(ELOOP)
    AIDAPTIV_ERRNO_NAME(ENODATA)
    AIDAPTIV_ERRNO_NAME(ETIME)
    AIDAPTIV_ERRNO_NAME(EOVERFLOW)
    AIDAPTIV_ERRNO_NAME(EOPNOTSUPP)
    AIDAPTIV_ERRNO_NAME(ECANCELED)
    AIDAPTIV_ERRNO_NAME(ETIMEDOUT)
    AIDAPTIV_ERRNO_NAME(EDQUOT)
    AIDAPTIV_ERRNO_NAME(ESTALE)
#undef AIDAPTIV_ERRNO_NAME
    default:
      return nullptr;
  }
}
#endif

}  // namespace

std::string errno_text(int err) {
  const char* name = errno_name(err);
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

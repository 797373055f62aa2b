// Errors of the aidaptiv engine and the checks that raise them.
//
// Every error is one sentence: what file or setting, the value, what was expected, what to do.
// They reach Python through bindings.cpp's translator: InvalidArgument -> ValueError, SystemError -> OSError
// with errno and filename (so FileNotFoundError, PermissionError, ... come out naturally), OutOfPinnedMemory
// -> MemoryError, any other Error -> RuntimeError (and std::bad_alloc -> MemoryError, every other
// std::exception -> RuntimeError). Nothing here aborts the process.
#pragma once

#include <cerrno>
#include <sstream>
#include <stdexcept>
#include <string>

namespace aidaptiv {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A bad argument: wrong alignment, size, dtype, unknown handle, closed engine.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// A failed system call; carries errno and the path involved (empty when there is none).
class SystemError : public Error {
 public:
  SystemError(int err, std::string path, const std::string& message)
      : Error(message), errno_(err), path_(std::move(path)) {}
  int error_code() const noexcept { return errno_; }
  const std::string& path() const noexcept { return path_; }

 private:
  int errno_;
  std::string path_;
};

// The pinned pool has no free block large enough.
class OutOfPinnedMemory : public Error {
 public:
  using Error::Error;
};

// "ENOENT (No such file or directory)"; the name falls back to the number on unknown codes.
std::string errno_text(int err);

// What to do about a failed file operation, by errno: the last clause of an error sentence.
std::string errno_advice(int err);

// Throws SystemError with "<action> failed: <ERRNO> (<text>): <advice>".
[[noreturn]] void throw_system_error(int err, const std::string& path, const std::string& action);

}  // namespace aidaptiv

// AIDAPTIV_EXPECT(cond, a << b << c): throw InvalidArgument with the streamed message unless cond.
#define AIDAPTIV_EXPECT(cond, message)                        \
  do {                                                        \
    if (!(cond)) {                                            \
      std::ostringstream aidaptiv_msg_;                       \
      aidaptiv_msg_ << message;                               \
      throw ::aidaptiv::InvalidArgument(aidaptiv_msg_.str()); \
    }                                                         \
  } while (0)

// AIDAPTIV_CHECK_SYSCALL(ret, path, action): a -1 return becomes SystemError from errno.
#define AIDAPTIV_CHECK_SYSCALL(ret, path, action)                  \
  do {                                                             \
    if ((ret) == -1) {                                             \
      const int aidaptiv_err_ = errno;                             \
      std::ostringstream aidaptiv_msg_;                            \
      aidaptiv_msg_ << action;                                     \
      ::aidaptiv::throw_system_error(aidaptiv_err_, (path), aidaptiv_msg_.str()); \
    }                                                              \
  } while (0)

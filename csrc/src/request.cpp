#include "aidaptiv/detail/request.hpp"

#include <sys/stat.h>

#include <algorithm>

#include "aidaptiv/error.hpp"

namespace aidaptiv::detail {

void PieceQueue::push(Request* r) {
  r->queued = true;
  queue_of(r).push_back(r);
}

bool PieceQueue::next(Piece* out) {
  for (;;) {
    std::deque<Request*>& q_ = !reads_.empty() ? reads_ : writes_;
    if (q_.empty()) break;
    Request* r = q_.front();
    if (r->failed || r->carved >= r->nbytes) {  // defensive: such requests leave the queue eagerly
      q_.pop_front();
      r->queued = false;
      maybe_complete(r);
      continue;
    }
    Piece p;
    p.req = r;
    p.buf = r->buf + r->carved;
    p.offset = r->offset + r->carved;
    const bool in_fixed = fixed_.length && p.buf >= fixed_.base && p.buf < fixed_.base + fixed_.length;
    const uint64_t chunk_index = in_fixed ? static_cast<uint64_t>(p.buf - fixed_.base) / fixed_.chunk : 0;
    const char* chunk_end =
        in_fixed ? fixed_.base + std::min(fixed_.length, (chunk_index + 1) * fixed_.chunk) : nullptr;
    if (r->carved < r->body) {
      p.len = std::min(block_size_, r->body - r->carved);
      // A registered buffer is one iovec: a piece must not cross into the next chunk. The chunk size
      // and the buffer are 4 KiB aligned, so the cut stays aligned.
      if (in_fixed) p.len = std::min<uint64_t>(p.len, static_cast<uint64_t>(chunk_end - p.buf));
    } else {
      p.len = r->nbytes - r->carved;
      p.buffered = true;
    }
    if (in_fixed && p.buf + p.len <= chunk_end) p.fixed_index = static_cast<int>(chunk_index);
    r->carved += p.len;
    r->outstanding++;
    if (r->carved == r->nbytes) {
      q_.pop_front();
      r->queued = false;
    }
    *out = p;
    return true;
  }
  return false;
}

void PieceQueue::finish(Piece& p) {
  Request* r = p.req;
  p.req = nullptr;
  r->outstanding--;
  maybe_complete(r);
}

void PieceQueue::fail(Piece& p, int err, const std::string& what_happened) {
  Request* r = p.req;
  if (!r->failed) {
    mark_failed(r, err);
    r->error.path = r->file->path();
    r->error.message = what_happened;
  }
  finish(p);
}

void PieceQueue::fail_noexcept(Piece& p, int err, const char* what_happened) noexcept {
  Request* r = p.req;
  if (!r) return;
  if (!r->failed) {
    mark_failed(r, err);
    try {
      r->error.path = r->file->path();
      r->error.message = describe(p) + " failed: " + what_happened;
    } catch (...) {
      // Out of memory again: the request still fails, with errno and as much text as could be kept.
    }
  }
  finish(p);
}

void PieceQueue::mark_failed(Request* r, int err) noexcept {
  r->failed = true;
  r->error.err = err;
  counters_->errors++;
  // Stop cutting: the rest of a failed request would only add noise (and writes past a limit). A deque
  // erase moves elements and never allocates.
  if (r->queued) {
    std::deque<Request*>& q_ = queue_of(r);
    q_.erase(std::find(q_.begin(), q_.end(), r));
    r->queued = false;
  }
}

namespace {
constexpr uint32_t kMaxRetries = 1000;  // per piece; -EAGAIN storms longer than this are errors
}

bool PieceQueue::complete(Piece& p, int64_t res) {
  if (p.req->failed) {  // drain only: the request already has its error
    finish(p);
    return false;
  }
  if ((res == -EAGAIN || res == -EINTR) && ++p.retries <= kMaxRetries) return true;
  if (res == -EINVAL && !p.buffered && !p.einval_retried) {
    // Our O_DIRECT pieces are 4 KiB aligned; the kernel still answers EINVAL when it cut the transfer
    // at an unaligned byte (a file-size limit, say). The buffered descriptor reports the real cause.
    // Counted (stats().direct_fallbacks, logged once by aidaptiv_ds.engine.io) because a filesystem that
    // refuses O_DIRECT this way would otherwise run every such piece through the page cache unseen.
    p.einval_retried = true;
    p.buffered = true;
    counters_->direct_fallbacks++;
    return true;
  }
  if (res < 0) {
    const int err = static_cast<int>(-res);
    fail(p, err, describe(p) + " failed: " + errno_text(err) + ": " + errno_advice(err));
    return false;
  }
  if (res == 0) {
    if (p.req->op == Op::Read) {
      struct stat st;
      const std::string size = fstat(p.req->file->direct_fd(), &st) == 0
                                   ? "the file is " + std::to_string(st.st_size) + " bytes long"
                                   : "the file is shorter";
      fail(p, ENODATA, describe(p) + " failed: end of file (" + size +
                           "): read only bytes that were written, or check the offset and size");
      return false;
    }
    if (++p.retries <= kMaxRetries) return true;
    fail(p, EIO, describe(p) + " failed: the kernel accepted no bytes after " + std::to_string(kMaxRetries) +
                     " tries: check the disk and dmesg");
    return false;
  }
  if (static_cast<uint64_t>(res) < p.len) {
    p.advance(static_cast<uint64_t>(res));
    p.retries = 0;
    return true;
  }
  finish(p);
  return false;
}

void PieceQueue::fail_all_queued(int err, const std::string& message) {
  std::deque<Request*> q;
  q.swap(reads_);
  q.insert(q.end(), writes_.begin(), writes_.end());
  writes_.clear();
  for (Request* r : q) {
    r->queued = false;
    if (!r->failed) {
      r->failed = true;
      r->error = {err, r->file->path(), message};
      counters_->errors++;
    }
    maybe_complete(r);
  }
}

void PieceQueue::maybe_complete(Request* r) {
  if (r->outstanding != 0 || r->queued) return;
  if (!r->failed) {
    if (r->op == Op::Read) {
      counters_->bytes_read += r->nbytes;
      counters_->reads++;
    } else {
      counters_->bytes_written += r->nbytes;
      counters_->writes++;
    }
  }
  r->mark_done();  // r may be gone after this
}

std::string PieceQueue::describe(const Piece& p) {
  const bool read = p.req->op == Op::Read;
  return std::string(read ? "read of " : "write of ") + std::to_string(p.len) + " bytes at offset " +
         std::to_string(p.offset) + (read ? " from " : " to ") + p.req->file->path();
}

}  // namespace aidaptiv::detail

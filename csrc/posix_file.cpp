#include "posix_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <sstream>

#include "fault_injection.hpp"

namespace dcpds {

std::string describe_errno(const std::string& op, int err, int64_t offset, uint64_t nbytes) {
  std::ostringstream os;
  os << op << " failed";
  if (offset >= 0) os << " at offset " << offset;
  if (nbytes > 0) os << " (" << nbytes << " bytes)";
  os << ": " << std::strerror(err);
  return os.str();
}

Fd& Fd::operator=(Fd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) ::close(fd_);
}

Fd Fd::try_open(const std::string& path, int flags, int mode, int* err) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  *err = fd < 0 ? errno : 0;
  return fd < 0 ? Fd() : Fd(fd, path);
}

Fd Fd::open(const std::string& path, int flags, int mode) {
  int err = 0;
  Fd f = try_open(path, flags, mode, &err);
  if (!f.valid()) throw IoError(err, path, -1, describe_errno("open", err, -1, 0));
  return f;
}

void Fd::pwrite_all(const void* buf, uint64_t len, uint64_t offset) const {
  pwritev_all({iovec{const_cast<void*>(buf), len}}, offset);
}

void Fd::pwritev_all(const std::vector<iovec>& iov, uint64_t offset) const {
  uint64_t len = 0;
  for (const iovec& v : iov) len += v.iov_len;
  std::vector<iovec> batch;
  batch.reserve(std::min<size_t>(iov.size(), IOV_MAX));
  size_t next = 0;      // first buffer not written completely
  uint64_t within = 0;  // bytes of iov[next] already written
  uint64_t done = 0;
  while (done < len) {
    uint64_t want = faults::limit_transfer(FaultOp::kWrite, path_, offset + done, len - done);
    batch.clear();
    for (size_t i = next; i < iov.size() && batch.size() < IOV_MAX && want > 0; ++i) {
      const uint64_t skip = i == next ? within : 0;
      const uint64_t take = std::min<uint64_t>(iov[i].iov_len - skip, want);
      if (take == 0) continue;
      batch.push_back({static_cast<char*>(iov[i].iov_base) + skip, take});
      want -= take;
    }
    ssize_t n = ::pwritev(fd_, batch.data(), static_cast<int>(batch.size()), static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw IoError(err, path_, static_cast<int64_t>(offset + done),
                    describe_errno("write", err, static_cast<int64_t>(offset + done), len - done));
    }
    if (n == 0) {
      throw IoError(EIO, path_, static_cast<int64_t>(offset + done),
                    "write made no progress at offset " + std::to_string(offset + done));
    }
    done += static_cast<uint64_t>(n);
    uint64_t advance = static_cast<uint64_t>(n);
    while (advance > 0) {
      const uint64_t rest = iov[next].iov_len - within;
      if (advance < rest) {
        within += advance;
        break;
      }
      advance -= rest;
      ++next;
      within = 0;
    }
  }
}

uint64_t Fd::pread_some(void* buf, uint64_t len, uint64_t offset) const {
  char* p = static_cast<char*>(buf);
  uint64_t done = 0;
  while (done < len) {
    const uint64_t want = faults::limit_transfer(FaultOp::kRead, path_, offset + done, len - done);
    ssize_t n = ::pread(fd_, p + done, want, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      throw IoError(err, path_, static_cast<int64_t>(offset + done),
                    describe_errno("read", err, static_cast<int64_t>(offset + done), len - done));
    }
    if (n == 0) break;  // end of file
    done += static_cast<uint64_t>(n);
  }
  return done;
}

void Fd::fsync() const {
  faults::check_call(FaultOp::kFsync, path_);
  int rc;
  do {
    rc = ::fsync(fd_);
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) {
    int err = errno;
    throw IoError(err, path_, -1, describe_errno("fsync", err, -1, 0));
  }
}

uint64_t Fd::size() const {
  struct stat st;
  if (::fstat(fd_, &st) < 0) {
    int err = errno;
    throw IoError(err, path_, -1, describe_errno("fstat", err, -1, 0));
  }
  return static_cast<uint64_t>(st.st_size);
}

void Fd::close() {
  if (fd_ < 0) return;
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) < 0 && errno != EINTR) {
    int err = errno;
    throw IoError(err, path_, -1, describe_errno("close", err, -1, 0));
  }
}

void fsync_directory(const std::string& dir) {
  Fd d = Fd::open(dir, O_RDONLY | O_DIRECTORY);
  d.fsync();
  d.close();
}

}  // namespace dcpds

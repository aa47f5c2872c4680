// The one error type the engine raises for failed I/O.
//
// It carries errno, the file and the byte offset so that the Python layer can
// turn it into an OSError whose message says what failed and where, and map
// the offset back to the state-dict key stored there. Nothing in the engine
// aborts the process on an I/O error: every failure ends up as one of these.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace dcpds {

class IoError : public std::runtime_error {
 public:
  IoError(int err, std::string path, int64_t offset, const std::string& what)
      : std::runtime_error(what), err_(err), path_(std::move(path)), offset_(offset) {}
  int err() const { return err_; }
  const std::string& path() const { return path_; }
  int64_t offset() const { return offset_; }  // -1 when not tied to an offset

 private:
  int err_;
  std::string path_;
  int64_t offset_;
};

// Builds "<op> failed at offset <o> (<n> bytes): <strerror>" style messages.
std::string describe_errno(const std::string& op, int err, int64_t offset, uint64_t nbytes);

}  // namespace dcpds

// Error types shared by every layer below the backend.
//
// Two kinds (shared/DESIGN.md): usage errors are raised at the call and name the
// op; runtime failures (timeouts, lost peers, I/O) travel through the Work and
// name the ranks involved. The backend maps them onto torch's exception types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <cstddef>
#include <utility>

namespace pycomm {

enum class ErrorKind { kUsage, kTimeout, kConnection, kInternal };

class Error : public std::runtime_error {
 public:
  // An error without a prefix: its detail is the whole message.
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  // "<prefix>: <detail>", with the prefix from errorPrefix() (common/call.h), e.g.
  // "pycomm allreduce (ring)"; the detail is what an aborting rank tells its peers.
  // The text is stored once; prefix() and detail() are its two parts.
  Error(ErrorKind kind, const std::string& prefix, const std::string& detail)
      : std::runtime_error(prefix.empty() ? detail : prefix + ": " + detail), kind_(kind),
        prefixLength_(prefix.size()) {}
  ErrorKind kind() const { return kind_; }
  std::string prefix() const { return std::string(what(), prefixLength_); }
  const char* detail() const { return prefixLength_ == 0 ? what() : what() + prefixLength_ + 2; }

 private:
  ErrorKind kind_;
  size_t prefixLength_ = 0;  // 0: no prefix
};

// Concatenates anything streamable into one string.
template <typename... Args>
std::string strCat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

template <typename... Args>
[[noreturn]] void throwError(ErrorKind kind, Args&&... args) {
  throw Error(kind, strCat(std::forward<Args>(args)...));
}

}  // namespace pycomm

#define PYCOMM_CHECK_USAGE(cond, ...)                                  \
  do {                                                                 \
    if (!(cond)) ::pycomm::throwError(::pycomm::ErrorKind::kUsage, __VA_ARGS__); \
  } while (0)

#define PYCOMM_CHECK_INTERNAL(cond, ...)                                    \
  do {                                                                      \
    if (!(cond))                                                            \
      ::pycomm::throwError(::pycomm::ErrorKind::kInternal, "internal error (", \
                           __FILE__, ":", __LINE__, "): ", __VA_ARGS__);    \
  } while (0)

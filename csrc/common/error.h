// Error types shared by every layer below the backend.
//
// Two kinds (shared/DESIGN.md): usage errors are raised at the call and name the
// op; runtime failures (timeouts, lost peers, I/O) travel through the Work and
// name the ranks involved. The backend maps them onto torch's exception types.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace pycomm {

enum class ErrorKind { kUsage, kTimeout, kConnection, kInternal };

class Error : public std::runtime_error {
 public:
  // `detail`: the message without its "pycomm <op> (<algorithm>): " prefix (empty
  // when there is none), e.g. what an aborting rank tells its peers.
  Error(ErrorKind kind, const std::string& message, std::string detail = "")
      : std::runtime_error(message), kind_(kind), detail_(std::move(detail)) {}
  ErrorKind kind() const { return kind_; }
  const char* detail() const { return detail_.empty() ? what() : detail_.c_str(); }

 private:
  ErrorKind kind_;
  std::string detail_;
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

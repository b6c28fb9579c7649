// File-descriptor helpers shared by the TCP transport's sources (tcp*.cc).
// Internal to csrc/transport/: nothing outside the TCP transport includes it.
#pragma once

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstring>
#include <string>

namespace pycomm {

inline std::string errnoText(int err) { return std::strerror(err); }

inline void setNonBlocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

inline void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace pycomm

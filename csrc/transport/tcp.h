// TCP transport: one connection per pair of ranks, non-blocking sockets, one
// I/O thread per transport (epoll). Sends are written from the posting thread
// when the socket has room (no hand-off for small messages); the rest, and every
// receive, is driven by the I/O thread. Messages that arrive before their
// receive is posted are buffered, so a send never waits for the receiver, up
// to a budget (TcpOptions::maxUnexpectedBytes): a message that would exceed it
// is not buffered; its sender's stream is left unread (parked) until a receive
// for it is posted or buffered messages are taken, so no peer decides how much
// memory this rank allocates.
//
// Bootstrap: each rank listens on an ephemeral port of `bindAddress`, publishes
// "address port" under `<prefix>addr/<rank>` in the store, connects to every
// lower rank and accepts every higher one, each connection authenticated both
// ways by a challenge-response handshake (wire.h). All of it runs in one poll()
// loop, each connection with its own deadline, so a silent connection delays
// nobody.
//
// Sources, one job each: tcp.cc (construction, abort, destruction),
// tcp_connect.cc (job secret, listener, address publication, handshakes),
// tcp_io.cc (the I/O thread: epoll loop, reading and writing the sockets, abort
// notices), tcp_match.cc (isend/irecv, matching incoming messages to posted
// receives, buffering the unexpected ones, failing a lost peer); tcp_socket.h
// holds their shared fd helpers.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/transport.h"
#include "transport/wire.h"

namespace pycomm {

struct TcpOptions {
  std::string bindAddress = "127.0.0.1";
  std::chrono::milliseconds connectTimeout{30000};
  std::string storePrefix;
  // The most payload bytes held for messages no receive has claimed yet.
  size_t maxUnexpectedBytes = size_t(1) << 30;
  // The job secret's text (PYCOMM_SECRET): every rank derives the handshake key
  // from it and nothing secret goes into the store. Empty: rank 0 draws a random
  // secret into the store (`<prefix>secret`), so store access means membership.
  std::string secret;
};

class TcpTransport : public Transport {
 public:
  TcpTransport(int rank, int size, KeyValueStore& store, const TcpOptions& options,
               std::vector<int> globalRanks = {});
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "tcp"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes) override;
  void abort(const std::string& reason) override;
  std::string describePending(int peer) override;
  uint64_t bytesSent() const override { return bytesSent_; }
  uint64_t bytesReceived() const override { return bytesReceived_; }

 private:
  struct PostedRecv {
    uint64_t tag = 0;
    char* data = nullptr;
    size_t bytes = 0;
    RequestPtr request;
  };
  // A message that arrived before its receive was posted.
  struct Unexpected {
    // Whether a receive claimed it while it was still arriving.
    enum class Claim {
      kNone,     // no: a receive posted later may still take it
      kWaiting,  // `waiter` gets the data when the message ends
      kDropped,  // a receive took it and has failed already (another size, or
                 // its peer was lost): the rest is read, then dropped, and no
                 // receive's buffer is ever written
    };
    uint64_t tag = 0;
    std::vector<char> data;
    bool complete = false;
    Claim claim = Claim::kNone;
    PostedRecv waiter;  // the claiming receive, when kWaiting
  };
  struct PendingSend {
    RequestPtr request;
    WireHeader header;
    const char* data;
    size_t bytes;
    size_t written;  // of header + payload
  };
  struct Peer {
    int fd = -1;
    // Guarded by mutex_.
    std::string failure;
    std::deque<PostedRecv> posted;
    std::deque<std::shared_ptr<Unexpected>> unexpected;
    // Guarded by sendMutex.
    std::mutex sendMutex;
    std::deque<PendingSend> sendQueue;
    bool writeArmed = false;
    bool readPaused = false;  // the epoll interest: EPOLLIN unless paused, EPOLLOUT when armed
    // Receive state machine: touched by the I/O thread only.
    WireHeader header{};
    size_t headerGot = 0;
    bool inPayload = false;
    char* dst = nullptr;
    size_t payloadBytes = 0;
    size_t payloadGot = 0;
    RequestPtr recvRequest;                  // matched a posted receive
    std::shared_ptr<Unexpected> recvBuffer;  // or is being buffered
    bool discarding = false;                 // or is being discarded (size mismatch)
    bool parked = false;                     // or waits unread: no receive, no budget
                                             // (written under mutex_)
    bool readingAbort = false;               // or is the peer's abort notice
    std::string abortText;
    std::atomic<uint64_t> messagesIn{0};     // headers read from this peer
    std::atomic<uint64_t> messagesOut{0};    // messages fully written to it
  };

  void connectMesh(KeyValueStore& store, const TcpOptions& options);
  void ioLoop();
  void handleReadable(int peer);
  void handleWritable(int peer);
  // After a header: points the payload at a posted receive, a buffer, the
  // discard path, or parks the stream. Returns whether reading may go on.
  bool matchIncoming(int peer);
  // Gives each parked stream another chance (a receive was posted, or budget freed).
  void retryParked();
  // Stops (or resumes) watching `peer`'s socket for reads, keeping writes armed.
  void pauseReads(int peer, bool paused);
  void finishIncoming(int peer);
  // Writes what the socket accepts; returns an error text ("" if none).
  std::string flushSends(int peer, std::vector<RequestPtr>& done);
  void armWrite(int peer, bool on);
  // Marks `peer` lost, fails what waits on it, and closes its socket. `reason`
  // completes "rank R lost the connection to rank P (reason)" unless
  // `fullMessage` says it is the whole message already.
  void failPeer(int peer, const std::string& reason, bool fullMessage = false);
  // Tells every connected peer why this rank is aborting (best effort).
  void sendAbortNotices(const std::string& reason);
  void wake();
  std::string lostMessage(int peer, const std::string& reason) const;

  const int rank_;
  const int size_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex mutex_;  // match lists, failures, abort state
  std::deque<PostedRecv> anyPosted_;
  const size_t maxUnexpectedBytes_;
  size_t unexpectedBytes_ = 0;          // payload bytes of `unexpected` entries
  std::atomic<int> parkedPeers_{0};
  std::string abortReason_;
  int listenFd_ = -1;
  int epollFd_ = -1;
  int wakeFd_ = -1;
  static constexpr uint64_t kWakeId = ~0ull;  // wakeFd_'s epoll id (a peer's is its rank)
  std::atomic<bool> stop_{false};
  std::thread ioThread_;
  std::vector<char> scratch_;
  std::atomic<uint64_t> bytesSent_{0};
  std::atomic<uint64_t> bytesReceived_{0};

  friend struct TcpTransportProbe;  // tests/cpp/transport_test.cc looks inside
};

}  // namespace pycomm

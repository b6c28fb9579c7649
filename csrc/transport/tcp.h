// TCP transport: `socketsPerPeer` connections (streams) per pair of ranks,
// non-blocking sockets, `ioThreads` epoll I/O threads per transport, each
// stream owned by one of them (spread round-robin). A message of at least
// 2 x kMinStripeBytes is cut into stripes, one per stream (wire.h: stripeCount,
// stripeOffset); stream 0 carries every header and the first stripe, the other
// streams only stripe payloads, in the order of the headers, so a receiver
// learns where stream k's next bytes go from stream 0. Messages between a pair
// stay FIFO per tag as with one stream. Sends are written from the posting thread
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
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "transport/hmac.h"
#include "transport/transport.h"
#include "transport/wire.h"

namespace pycomm {

struct TcpOptions {
  std::string bindAddress = "127.0.0.1";
  std::chrono::milliseconds connectTimeout{30000};
  std::string storePrefix;
  // The most payload bytes held for messages no receive has claimed yet.
  size_t maxUnexpectedBytes = size_t(1) << 30;
  // The most such messages held per peer, whatever their size (empty ones cost a
  // record each and nothing against the byte budget); past it the peer's stream
  // waits unread, as past the byte budget.
  size_t maxUnexpectedMessages = size_t(1) << 16;
  // The job secret's text (PYCOMM_SECRET): every rank derives the handshake key
  // from it and nothing secret goes into the store. Empty: rank 0 draws a random
  // secret into the store (`<prefix>secret`), so store access means membership.
  std::string secret;
  // Streams per pair of ranks (1..kMaxStreams); rank 0's value is used by every rank.
  int socketsPerPeer = 1;
  // epoll threads (1..kMaxIoThreads; at most one per stream).
  int ioThreads = 1;
  // PYCOMM_WIRE: kWireIntegrity authenticates every frame (wire.h); kWireNone only
  // the connection. Every rank must run the same (the handshake fails otherwise).
  uint32_t wire = kWireIntegrity;
};

constexpr int kMaxIoThreads = 16;

class TcpTransport : public Transport {
 public:
  TcpTransport(int rank, int size, KeyValueStore& store, const TcpOptions& options,
               std::vector<int> globalRanks = {});
  ~TcpTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "tcp"; }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override;
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) override;
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
    bool upTo = false;  // a message of at most `bytes` fits (irecv's upTo)
    bool fits(size_t sent) const { return receiveFits(sent, bytes, upTo); }
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
    // The payload: not zeroed first, since the socket writes every byte of it
    // before anything reads it (a message that ends early is dropped).
    class Bytes {
     public:
      void resize(size_t n) {
        bytes_.reset(n > 0 ? new char[n] : nullptr);
        size_ = n;
      }
      char* data() { return bytes_.get(); }
      size_t size() const { return size_; }
      bool empty() const { return size_ == 0; }

     private:
      std::unique_ptr<char[]> bytes_;
      size_t size_ = 0;
    };
    uint64_t tag = 0;
    uint64_t order = 0;    // arrival order among its peer's messages
    bool indexed = false;  // in its peer's `unclaimed` indexes (unclaimed, not dropped)
    Bytes data;
    bool complete = false;
    Claim claim = Claim::kNone;
    PostedRecv waiter;  // the claiming receive, when kWaiting
  };
  // A message being received over one or more streams; the last stripe to end
  // (or be abandoned) settles it, so no request completes while a stream still
  // writes into its buffer.
  struct Inbound {
    RequestPtr request;                  // matched a posted receive
    std::shared_ptr<Unexpected> buffer;  // or is being buffered
    bool discarding = false;             // or is being discarded (size mismatch)
    bool abortNotice = false;            // or is the peer's abort notice
    char* dst = nullptr;
    size_t bytes = 0;
    std::atomic<int> stripesLeft{1};
    std::atomic<bool> lost{false};       // a stripe was abandoned (its peer was lost)
  };
  struct Stripe {
    std::shared_ptr<Inbound> message;
    size_t offset = 0;
    size_t bytes = 0;
  };
  // A message being sent, over one or more streams.
  struct Outbound {
    RequestPtr request;
    size_t bytes = 0;
    std::atomic<int> stripesLeft{1};
  };
  struct PendingSend {
    std::shared_ptr<Outbound> message;
    WireHeader header;
    bool withHeader;  // stream 0 sends the header first; the others payload only
    const char* data;
    size_t bytes;
    size_t written;   // of header (and its tag) + payload (and its tag)
    // Wire integrity: the frames' MACs, computed as the bytes are written.
    bool macStarted = false;  // sequence numbers taken, header tag made
    bool tagReady = false;    // payloadTag holds the payload's MAC
    size_t macked = 0;        // payload bytes fed to the MAC
    uint8_t headerTag[kFrameTagBytes];
    uint8_t payloadTag[kFrameTagBytes];
  };
  struct Stream {
    int fd = -1;
    int peer = -1;
    int index = 0;   // 0 carries the headers
    int thread = 0;  // the I/O thread that owns it
    // Guarded by mutex.
    std::mutex mutex;
    std::deque<PendingSend> sendQueue;
    bool writeArmed = false;
    // Set when a write met the peer's reset (EPIPE, ECONNRESET): that error, which
    // every later flush returns; nothing more is written or armed, and the queue
    // waits for failPeer (sendFailed).
    std::string resetError;
    // Wire integrity (null without): this direction's frame MAC and sequence number.
    std::unique_ptr<HmacSha256> sendMac;
    uint64_t sendSequence = 0;
    bool readPaused = false;  // the epoll interest: EPOLLIN unless paused, EPOLLOUT when armed
    std::deque<Stripe> stripes;  // streams > 0: the stripes announced on stream 0, in order
    bool stripesClosed = false;  // its peer failed: stripes announced now are dropped at once
    // Receive state machine: touched by the owning I/O thread only.
    bool detached = false;  // taken out of its epoll set after its peer failed
    WireHeader header{};    // stream 0
    size_t headerGot = 0;
    bool inPayload = false;
    Stripe current;
    size_t got = 0;
    // Wire integrity (null without): the incoming frames' MAC, their sequence
    // number, and the tag being read after a header or a stripe.
    std::unique_ptr<HmacSha256> recvMac;
    uint64_t recvSequence = 0;
    bool inTag = false;
    size_t tagGot = 0;
    uint8_t tag[kFrameTagBytes];
  };
  struct Peer {
    std::vector<std::unique_ptr<Stream>> streams;
    // Held while a message's stripes are queued, so every stream sees messages
    // in the same order.
    std::mutex postMutex;
    // Guarded by mutex_.
    std::string failure;
    std::deque<PostedRecv> posted;
    std::map<uint64_t, std::shared_ptr<Unexpected>> unexpected;  // by arrival order (Unexpected::order)
    // The unclaimed ones of `unexpected`, indexed so a receive finds its match
    // without a scan: by tag outside the call bits (a message with the receive's
    // tag or another call's, in arrival order), and collective ones by tag space
    // and sequence number (earlier collectives' messages, earlierCall).
    std::unordered_map<uint64_t, std::deque<Unexpected*>> unclaimedByCall;
    std::multimap<uint64_t, Unexpected*> unclaimedBySequence;
    uint64_t arrivals = 0;
    bool parked = false;  // stream 0 waits unread after a header: no receive, no budget
                          // (written under mutex_ by stream 0's thread)
    std::string abortText;                // stream 0's thread only
    std::atomic<bool> noticeArriving{false};  // stream 0 read an abort notice's header
    std::atomic<uint64_t> messagesIn{0};  // headers read from this peer
    std::atomic<uint64_t> messagesOut{0}; // messages fully written to it
  };
  struct IoThread {
    int epollFd = -1;
    int wakeFd = -1;
    std::thread thread;
    std::vector<char> scratch;
  };

  void connectMesh(KeyValueStore& store, const TcpOptions& options);
  void ioLoop(int thread);
  void handleReadable(int peer, int stream);
  void handleWritable(int peer, int stream);
  // After a header on stream 0: points the payload at a posted receive, a
  // buffer, the discard path, or parks the stream; queues the other stripes on
  // their streams. Returns whether reading may go on.
  bool matchIncoming(int peer);
  // Adds a buffered message to (or takes it out of) its peer's unclaimed
  // indexes; under mutex_.
  static void indexUnexpected(Peer& p, const std::shared_ptr<Unexpected>& u);
  static void unindexUnexpected(Peer& p, Unexpected& u);
  // The unclaimed message from `p` a receive of `tag` meets first: one of its
  // call (same tag, or another call's), or an earlier collective's; null if none.
  static Unexpected* firstUnclaimed(Peer& p, uint64_t tag);
  // Gives each parked stream owned by `thread` another chance.
  void retryParked(int thread);
  // Stops (or resumes) watching a stream's socket for reads, keeping writes armed.
  void pauseReads(Stream& s, bool paused);
  // After a header is matched (or a stripe taken): reads its payload next (its
  // frame MAC begun), or settles an empty one.
  void startPayload(int peer, Stream& s);
  // Checks the frame tag just read on `s`; false (and `peer` failed) when it is wrong.
  bool checkFrameTag(int peer, Stream& s);
  // Stream `s` read all of its current stripe; the last stripe settles the message.
  void finishStripe(int peer, Stream& s);
  void finishIncoming(int peer, const std::shared_ptr<Inbound>& message);
  // Abandons one stripe of `message` (its peer was lost); the last one fails its receive.
  void dropStripe(int peer, const std::shared_ptr<Inbound>& message);
  // A message some stripe of which was lost, once no stream writes into it.
  void failLostMessage(int peer, const std::shared_ptr<Inbound>& message);
  // Writes what the socket accepts; returns an error text ("" if none).
  std::string flushSends(int peer, Stream& s, std::vector<RequestPtr>& done);
  // A write to `peer` failed with `error` (`reset`: the peer reset the
  // connection): fails the peer, unless its abort notice may still wait unread
  // on stream 0 (noticeMayWait), whose reader then fails it; without locks.
  void sendFailed(int peer, const std::string& error, bool reset);
  bool noticeMayWait(int peer);
  void armWrite(Stream& s, bool on);  // under s.mutex
  // Marks `peer` lost, fails what waits on it, and shuts its sockets. `reason`
  // completes "rank R lost the connection to rank P (reason)" unless
  // `fullMessage` says it is the whole message already. `endedStream` >= 0: the
  // peer ended that stream in order (its end, or its abort notice, came after all
  // it wrote there), so it is leaving, not cut off; its other streams may still
  // hold stripes of messages announced before, which other I/O threads read.
  // Those streams go on reading them to their own end: a message the peer sent
  // whole before it left completes, one cut short fails when its stream ends.
  void failPeer(int peer, const std::string& reason, bool fullMessage = false, int endedStream = -1);
  // Takes a stream out of its I/O thread's epoll set and abandons the stripes it
  // was reading or had queued; only on that thread.
  void detachStream(int peer, Stream& s);
  // Tells every connected peer why this rank is aborting (best effort).
  void sendAbortNotices(const std::string& reason);
  void wake();
  int currentIoThread() const;  // -1 off the I/O threads
  std::string lostMessage(int peer, const std::string& reason) const;
  // Under mutex_: the failure of the first peer when every peer is lost (receives
  // from any source can no longer be met), else "".
  std::string everyPeerLostLocked() const;
  static uint64_t eventId(int peer, int stream) { return static_cast<uint64_t>(peer) * kMaxStreams + stream; }

  const int rank_;
  const int size_;
  std::vector<std::unique_ptr<Peer>> peers_;
  std::mutex mutex_;  // match lists, failures, abort state
  std::deque<PostedRecv> anyPosted_;
  const size_t maxUnexpectedBytes_;
  const size_t maxUnexpectedMessages_;
  size_t unexpectedBytes_ = 0;          // payload bytes of `unexpected` entries
  std::atomic<int> parkedPeers_{0};
  std::string abortReason_;
  int listenFd_ = -1;
  int socketsPerPeer_ = 1;  // rank 0's choice, agreed at connection time
  uint32_t wire_ = kWireIntegrity;
  std::vector<IoThread> io_;
  static constexpr uint64_t kWakeId = ~0ull;  // wakeFd's epoll id (a stream's is eventId())
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> bytesSent_{0};
  std::atomic<uint64_t> bytesReceived_{0};

  friend struct TcpTransportProbe;  // tests/cpp/transport_test.cc looks inside
};

}  // namespace pycomm

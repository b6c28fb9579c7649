// A view of some ranks of a transport as a group of their own (the host
// leaders of the hierarchical all-reduce). Sub-rank i is parent rank ranks[i];
// tags get bit 62 so the view's messages never match the parent's collectives.
#pragma once

#include <vector>

#include "common/error.h"
#include "transport/transport.h"

namespace pycomm {

class SubTransport : public Transport {
 public:
  static constexpr uint64_t kTagBit = 1ull << 62;

  SubTransport(Transport& parent, std::vector<int> ranks) : parent_(parent), ranks_(std::move(ranks)) {
    for (size_t i = 0; i < ranks_.size(); ++i)
      if (ranks_[i] == parent_.rank()) rank_ = static_cast<int>(i);
    PYCOMM_CHECK_INTERNAL(rank_ >= 0, "rank ", parent_.rank(), " is not in the sub-group");
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(ranks_.size()); }
  const char* name() const override { return parent_.name(); }
  RequestPtr isend(int peer, uint64_t tag, const void* data, size_t bytes) override {
    return wrap(parent_.isend(parentRank(peer), tag | kTagBit, data, bytes), peer, bytes);
  }
  RequestPtr irecv(int peer, uint64_t tag, void* data, size_t bytes, bool upTo = false) override {
    return wrap(parent_.irecv(peer == kAnySource ? kAnySource : parentRank(peer), tag | kTagBit, data, bytes, upTo),
                peer, bytes);
  }
  void abort(const std::string& reason) override { parent_.abort(reason); }
  std::string describePending(int peer) override {
    return peer >= 0 ? parent_.describePending(parentRank(peer)) : "";
  }
  uint64_t bytesSent() const override { return parent_.bytesSent(); }
  uint64_t bytesReceived() const override { return parent_.bytesReceived(); }
  std::string rankName(int subRank) const override {
    return subRank >= 0 && static_cast<size_t>(subRank) < ranks_.size() ? parent_.rankName(ranks_[subRank])
                                                                          : Transport::rankName(subRank);
  }

 private:
  // The parent's request names parent ranks; callers of this view expect
  // sub-ranks (in peer(), sourceRank() and errors about them).
  RequestPtr wrap(const RequestPtr& inner, int peer, size_t bytes) {
    auto outer = std::make_shared<Request>(peer, bytes);
    std::vector<int> ranks = ranks_;
    inner->onComplete([outer, inner, ranks] {
      if (inner->failed()) return outer->fail(inner->error());
      int source = -1;
      for (size_t i = 0; i < ranks.size(); ++i)
        if (ranks[i] == inner->sourceRank()) source = static_cast<int>(i);
      outer->complete(source);
    });
    return outer;
  }

  int parentRank(int peer) const {
    PYCOMM_CHECK_INTERNAL(peer >= 0 && static_cast<size_t>(peer) < ranks_.size(), "sub-rank ", peer,
                          " of a sub-group of ", ranks_.size());
    return ranks_[peer];
  }

  Transport& parent_;
  std::vector<int> ranks_;
  int rank_ = -1;
};

}  // namespace pycomm

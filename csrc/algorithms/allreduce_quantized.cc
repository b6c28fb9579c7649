// Quantized all-reduce in two phases (float32 in, float32 sum out).
//
// The buffer is a run of segments (parameters); rank c owns chunk c of every segment,
// a run of whole quantization blocks counted from the segment's start (ownership.h).
// Blocks therefore never straddle two segments, and every element is handled the same
// way whatever other segments share its buffer.
//
//   phase 1 (reduce-scatter): every rank quantizes each of its pieces
//            (kernels/cpu/quantize: 8/4/1 bits, per-block scale) and sends each owner
//            the concatenated codes of that owner's pieces; the owner dequantizes the
//            n contributions and sums them in float32 in rank order (0, 1, ..., n-1).
//   phase 2 (all-gather):     the owner quantizes its reduced pieces once more and
//            sends the codes to every rank; every rank (the owner included) dequantizes
//            every piece, so the result is bit-identical everywhere.
//
// Stochastic rounding draws from seeds mixed from (opts.seed, the segment's key, the
// sending rank, the chunk) in phase 1 and (opts.seed, key, chunk) in phase 2.
//
// Error feedback (residual != nullptr): phase 1 quantizes input + residual and
// leaves residual = (input + residual) - decoded codes (the fused kernel); the owner
// then adds the error of its phase-2 requantization, (sum - decoded sum), to its
// residual over its pieces. The error phase 2 makes is thereby fed back through the
// owner's next contribution, and sum over ranks of (input + old residual) equals
// the result plus the sum over ranks of the new residuals, up to float rounding.
//
// Bytes sent per rank: the packed size of the other owners' pieces in phase 1,
// (n-1) times its own pieces' in phase 2: about 2(n-1)/n of the packed buffer.
#include <algorithm>
#include <vector>

#include "algorithms/collectives.h"
#include "algorithms/ownership.h"
#include "kernels/cpu/quantize.h"

namespace pycomm {
namespace {

uint64_t mixSeed(uint64_t seed, std::initializer_list<uint64_t> values) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  for (uint64_t v : values) {
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  return h;
}

// Packed bytes of owner c's pieces, and where each piece's codes start.
size_t packPlan(const std::vector<Piece>& pieces, const QuantizeOptions& opts,
                std::vector<size_t>* at) {
  size_t bytes = 0;
  if (at) at->clear();
  for (const Piece& p : pieces) {
    if (at) at->push_back(bytes);
    bytes += packedSize(p.length, opts.bits, opts.block);
  }
  return bytes;
}

}  // namespace

size_t quantizedAllreduceBytes(size_t count, const std::vector<size_t>& segments,
                               const QuantizeOptions& opts, int worldSize, int rank) {
  const Ownership own = segmentOwnership(segments, count, worldSize, opts.block);
  size_t bytes = 0;
  for (int c = 0; c < worldSize; ++c) {
    const size_t packed = packPlan(own.pieces[c], opts, nullptr);
    bytes += c == rank ? packed * (worldSize - 1) : packed;
  }
  return bytes;
}

void allreduceQuantized(Comm& comm, float* buf, size_t count, const std::vector<size_t>& segments,
                        const std::vector<uint64_t>& segmentKeys, const QuantizeOptions& opts,
                        float* residual) {
  checkQuantizeOptions("allreduce_quantized", opts.bits, opts.block);
  PYCOMM_CHECK_USAGE(segmentKeys.empty() || segmentKeys.size() == std::max<size_t>(segments.size(), 1),
                     "pycomm allreduce_quantized: ", segmentKeys.size(), " segment keys for ",
                     segments.size(), " segments");
  const int n = comm.size();
  const int r = comm.rank();
  const Ownership own = segmentOwnership(segments, count, n, opts.block);
  auto key = [&](size_t s) { return segmentKeys.empty() ? static_cast<uint64_t>(s) : segmentKeys[s]; };
  std::vector<std::vector<size_t>> pieceAt(n);
  std::vector<size_t> packed(n), packedAt(n + 1, 0);
  for (int c = 0; c < n; ++c) {
    packed[c] = packPlan(own.pieces[c], opts, &pieceAt[c]);
    packedAt[c + 1] = packedAt[c] + packed[c];
  }
  const size_t mine = own.owned[r];

  // slot 0: this rank's phase-1 codes for every owner, then (reused) every owner's phase-2 codes
  // slot 1: every rank's phase-1 codes of my pieces; slot 2: my float32 sum; slot 3: decode scratch
  uint8_t* codes = reinterpret_cast<uint8_t*>(comm.scratch(0, packedAt[n]));
  uint8_t* incoming = reinterpret_cast<uint8_t*>(comm.scratch(1, packed[r] * n));
  float* sum = reinterpret_cast<float*>(comm.scratch(2, mine * sizeof(float)));
  float* decoded = reinterpret_cast<float*>(comm.scratch(3, mine * sizeof(float)));

  // ---- phase 1: each owner's pieces, quantized, to the owner
  for (int c = 0; c < n; ++c) {
    uint8_t* base = c == r ? incoming + packed[r] * r : codes + packedAt[c];
    for (size_t j = 0; j < own.pieces[c].size(); ++j) {
      const Piece& p = own.pieces[c][j];
      QuantizeOptions o = opts;
      o.seed = mixSeed(opts.seed, {key(p.segment), static_cast<uint64_t>(r), static_cast<uint64_t>(c)});
      if (residual != nullptr)
        quantizeErrorFeedback(buf + p.global, residual + p.global, p.length, o, base + pieceAt[c][j]);
      else
        quantize(buf + p.global, p.length, o, base + pieceAt[c][j]);
    }
  }
  std::vector<RequestPtr> recvs(n), sends;
  for (int k = 1; k < n; ++k) {
    const int peer = (r + k) % n;
    recvs[peer] = comm.recv(peer, incoming + packed[r] * peer, packed[r]);
  }
  for (int k = 1; k < n; ++k) {
    const int owner = (r + n - k) % n;  // staggered so owners are not all hit at once
    sends.push_back(comm.send(owner, codes + packedAt[owner], packed[owner]));
  }
  const std::vector<Piece>& mp = own.pieces[r];
  for (int p = 0; p < n; ++p) {  // rank order: the same float sum whoever owns the chunk
    if (p != r) comm.wait(recvs[p]);
    const uint8_t* from = incoming + packed[r] * p;
    float* into = p == 0 ? sum : decoded;
    for (size_t j = 0; j < mp.size(); ++j)
      dequantize(from + pieceAt[r][j], mp[j].length, opts.bits, opts.block, into + mp[j].local);
    if (p != 0)
      for (size_t i = 0; i < mine; ++i) sum[i] += decoded[i];
  }
  comm.waitAll(sends);

  // ---- phase 2: the reduced pieces, requantized, to every rank
  uint8_t* mineCodes = codes + packedAt[r];
  for (size_t j = 0; j < mp.size(); ++j) {
    QuantizeOptions o = opts;
    o.seed = mixSeed(opts.seed, {key(mp[j].segment), static_cast<uint64_t>(n + r), 0x5EC0DDull});
    quantize(sum + mp[j].local, mp[j].length, o, mineCodes + pieceAt[r][j]);
    dequantize(mineCodes + pieceAt[r][j], mp[j].length, opts.bits, opts.block, decoded + mp[j].local);
    if (residual != nullptr) {
      float* e = residual + mp[j].global;
      const float* s = sum + mp[j].local;
      const float* d = decoded + mp[j].local;
      for (size_t i = 0; i < mp[j].length; ++i) e[i] += s[i] - d[i];
    }
  }
  std::vector<RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int owner = (r + k) % n;
    requests.push_back(comm.recv(owner, codes + packedAt[owner], packed[owner]));
  }
  for (int k = 1; k < n; ++k) requests.push_back(comm.send((r + n - k) % n, mineCodes, packed[r]));
  comm.waitAll(requests);
  for (int c = 0; c < n; ++c)
    for (size_t j = 0; j < own.pieces[c].size(); ++j) {
      const Piece& p = own.pieces[c][j];
      dequantize(codes + packedAt[c] + pieceAt[c][j], p.length, opts.bits, opts.block, buf + p.global);
    }
}

}  // namespace pycomm

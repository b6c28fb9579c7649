// Quantized all-reduce in two phases (float32 in, float32 sum out).
//
// Rank c owns chunk c: a run of whole quantization blocks (quantizedChunkOffsets),
// so every block of every chunk lies on the grid of the whole buffer.
//
//   phase 1 (reduce-scatter): every rank quantizes each chunk of its input
//            (kernels/cpu/quantize: 8/4/1 bits, per-block scale) and sends chunk c
//            to its owner; the owner dequantizes the n contributions and sums them
//            in float32 in rank order (0, 1, ..., n-1).
//   phase 2 (all-gather):     the owner quantizes its reduced chunk once more and
//            sends the codes to every rank; every rank (the owner included)
//            dequantizes every chunk, so the result is bit-identical everywhere.
//
// Error feedback (residual != nullptr): phase 1 quantizes input + residual and
// leaves residual = (input + residual) - decoded codes (the fused kernel); the owner
// then adds the error of its phase-2 requantization, (sum - decoded sum), to its
// residual over its chunk. The error phase 2 makes is thereby fed back through the
// owner's next contribution, and sum over ranks of (input + old residual) equals
// the result plus the sum over ranks of the new residuals, up to float rounding.
//
// Bytes sent per rank: sum over the other chunks of their packed size in phase 1,
// (n-1) times the packed own chunk in phase 2: about 2(n-1)/n of the packed buffer.
#include <algorithm>
#include <vector>

#include "algorithms/collectives.h"
#include "kernels/cpu/quantize.h"

namespace pycomm {
namespace {

uint64_t mixSeed(uint64_t seed, uint64_t a, uint64_t b) {
  uint64_t h = seed ^ 0x9E3779B97F4A7C15ull;
  for (uint64_t v : {a, b}) {
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 29;
  }
  return h;
}

}  // namespace

std::vector<size_t> quantizedChunkOffsets(size_t count, size_t block, int parts) {
  const size_t blocks = block == 0 ? 0 : (count + block - 1) / block;
  std::vector<size_t> offsets = balancedOffsets(blocks, parts);
  for (auto& offset : offsets) offset = std::min(count, offset * block);
  return offsets;
}

size_t quantizedAllreduceBytes(size_t count, const QuantizeOptions& opts, int worldSize, int rank) {
  const std::vector<size_t> offsets = quantizedChunkOffsets(count, opts.block, worldSize);
  size_t bytes = 0;
  for (int c = 0; c < worldSize; ++c) {
    const size_t packed = packedSize(offsets[c + 1] - offsets[c], opts.bits, opts.block);
    bytes += c == rank ? packed * (worldSize - 1) : packed;
  }
  return bytes;
}

void allreduceQuantized(Comm& comm, float* buf, size_t count, const QuantizeOptions& opts,
                        float* residual) {
  checkQuantizeOptions("allreduce_quantized", opts.bits, opts.block);
  const int n = comm.size();
  const int r = comm.rank();
  const std::vector<size_t> offsets = quantizedChunkOffsets(count, opts.block, n);
  std::vector<size_t> packed(n), packedAt(n + 1, 0);
  for (int c = 0; c < n; ++c) {
    packed[c] = packedSize(offsets[c + 1] - offsets[c], opts.bits, opts.block);
    packedAt[c + 1] = packedAt[c] + packed[c];
  }
  const size_t mine = offsets[r + 1] - offsets[r];

  // slot 0: this rank's phase-1 codes of every chunk, then (reused) every owner's phase-2 codes
  // slot 1: every rank's phase-1 codes of my chunk; slot 2: my float32 sum; slot 3: decode scratch
  uint8_t* codes = reinterpret_cast<uint8_t*>(comm.scratch(0, packedAt[n]));
  uint8_t* incoming = reinterpret_cast<uint8_t*>(comm.scratch(1, packed[r] * n));
  float* sum = reinterpret_cast<float*>(comm.scratch(2, mine * sizeof(float)));
  float* decoded = reinterpret_cast<float*>(comm.scratch(3, mine * sizeof(float)));

  // ---- phase 1: each chunk, quantized, to its owner
  for (int c = 0; c < n; ++c) {
    QuantizeOptions o = opts;
    o.seed = mixSeed(opts.seed, static_cast<uint64_t>(r), static_cast<uint64_t>(c));
    const size_t elems = offsets[c + 1] - offsets[c];
    uint8_t* out = c == r ? incoming + packed[r] * r : codes + packedAt[c];
    if (residual != nullptr)
      quantizeErrorFeedback(buf + offsets[c], residual + offsets[c], elems, o, out);
    else
      quantize(buf + offsets[c], elems, o, out);
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
  for (int p = 0; p < n; ++p) {  // rank order: the same float sum whoever owns the chunk
    if (p != r) comm.wait(recvs[p]);
    const uint8_t* from = incoming + packed[r] * p;
    if (p == 0) {
      dequantize(from, mine, opts.bits, opts.block, sum);
    } else {
      dequantize(from, mine, opts.bits, opts.block, decoded);
      for (size_t i = 0; i < mine; ++i) sum[i] += decoded[i];
    }
  }
  comm.waitAll(sends);

  // ---- phase 2: the reduced chunk, requantized, to every rank
  {
    QuantizeOptions o = opts;
    o.seed = mixSeed(opts.seed, static_cast<uint64_t>(n + r), 0x5EC0DDull);
    quantize(sum, mine, o, codes + packedAt[r]);
    dequantize(codes + packedAt[r], mine, opts.bits, opts.block, decoded);
    if (residual != nullptr) {
      float* e = residual + offsets[r];
      for (size_t i = 0; i < mine; ++i) e[i] += sum[i] - decoded[i];
    }
  }
  std::vector<RequestPtr> requests;
  for (int k = 1; k < n; ++k) {
    const int owner = (r + k) % n;
    requests.push_back(comm.recv(owner, codes + packedAt[owner], packed[owner]));
  }
  for (int k = 1; k < n; ++k) requests.push_back(comm.send((r + n - k) % n, codes + packedAt[r], packed[r]));
  comm.waitAll(requests);
  for (int c = 0; c < n; ++c)
    dequantize(codes + packedAt[c], offsets[c + 1] - offsets[c], opts.bits, opts.block,
               buf + offsets[c]);
}

}  // namespace pycomm

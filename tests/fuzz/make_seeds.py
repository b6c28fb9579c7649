"""Writes the seed corpora of the libFuzzer targets (tests/fuzz/corpus/<target>/),
each a few small inputs in the format the target's header comment describes: well
formed ones (valid keys and MACs where the target checks them) and one or two of
each kind of damage, so that `make fuzz` starts from the accepting paths rather
than from the first bytes it guesses. Run from anywhere: python tests/fuzz/make_seeds.py"""
import hashlib
import hmac
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
WIRE_VERSION = 4


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(bytes(data))


def frames():
    # byte 0 options, byte 1 junk length, then ops: 0 recv [tag, shape, bytes],
    # 1 message [shape, tag, len, payload, (fields), corrupt, (where)], 3 raw [len, bytes], 4 pause [n].
    recv = lambda tag, nbytes, shape=0: [0, tag, shape, nbytes]
    msg = lambda tag, payload, shape=0, extra=(), corrupt=0, where=(): (
        [1, shape, tag, len(payload)] + list(payload) + list(extra) + [corrupt] + list(where))
    eight = list(range(8))
    write("fuzz_frames", "recv_then_message", [0, 0] + recv(1, 8) + msg(1, eight))
    write("fuzz_frames", "message_then_recv", [0, 0] + msg(1, eight) + [4, 3] + recv(1, 8))
    write("fuzz_frames", "tampered_payload", [0, 0] + recv(1, 8) + msg(1, eight, corrupt=0x50, where=[3]))
    write("fuzz_frames", "tampered_header_tag", [0, 0] + recv(1, 8) + msg(1, eight, corrupt=0x30, where=[9]))
    write("fuzz_frames", "replayed_sequence", [0, 0] + msg(2, [1, 2, 3, 4], corrupt=0x80) + msg(2, [5, 6, 7, 8])
          + recv(2, 4) + recv(2, 4))
    write("fuzz_frames", "wire_none", [1, 0] + recv(1, 8) + msg(1, eight) + msg(0, []) + recv(0, 0))
    write("fuzz_frames", "abort_notice", [0, 0] + recv(1, 8) + msg(1, list(b"bye"), shape=4, extra=[1]))
    write("fuzz_frames", "lying_length", [0, 0] + recv(1, 8) + msg(1, eight, shape=2, extra=list(struct.pack("<Q", 16))))
    write("fuzz_frames", "small_budgets", [6, 0] + msg(1, eight) + msg(2, eight) + msg(3, eight) + [4, 3]
          + recv(3, 8) + recv(2, 8) + recv(1, 8))
    write("fuzz_frames", "up_to_and_collective", [0, 0] + recv(4, 16, shape=2) + msg(4, eight)
          + recv(6, 4, shape=1) + msg(6, list(range(16)), shape=1))
    write("fuzz_frames", "raw_bytes", [0, 0] + recv(1, 8) + [3, 5, 1, 2, 3, 4, 5] + msg(1, eight))
    hello = struct.pack("<IIiiiI", 0x50434d48, WIRE_VERSION, 1, 2, 0, 0) + bytes(16) + bytes(range(1, 17)) + struct.pack("<II", 1, 0)
    write("fuzz_frames", "junk_hello_then_proof", [0, 64 + 40] + [1] + list(hello[1:]) + [0x55] * 40 + recv(1, 8) + msg(1, eight))


def wire():
    key = hmac.new(b"fuzzing secret", b"pycomm handshake key", hashlib.sha256).digest()
    group = bytes(range(1, 17))

    def mac(role, size, connector, acceptor, nonce_c, nonce_a, mode):
        label = f"pycomm/{WIRE_VERSION} {role}".encode() + b"\0"
        data = label + group + struct.pack("<iii", size, connector, acceptor) + nonce_c + nonce_a + struct.pack("<i", mode)
        return hmac.new(key, data, hashlib.sha256).digest()

    nonce_c = bytes([2]) + bytes(range(15))  # the target's acceptor: rank nonce_c[0] % 4 = 2
    nonce_a = bytes(range(100, 116))
    for mode in (0, 1):
        hello = struct.pack("<4I", 0x50434d48, WIRE_VERSION, 5, 8) + struct.pack("<iI", 2, 0) + group + nonce_c + struct.pack("<II", mode, 0)
        challenge = struct.pack("<II", 0x50434d43, WIRE_VERSION) + nonce_a + mac("acceptor", 8, 5, 2, nonce_c, nonce_a, mode)
        proof = struct.pack("<II", 0x50434d50, 0) + mac("connector", 8, 5, 2, nonce_c, nonce_a, mode)
        header = struct.pack("<IIQQ", 0x50434d44, 0, 7, 4) + b"data"
        notice = struct.pack("<IIQQ", 0x50434d44, 1, 0, 5) + b"bye\x01\xff"
        write("fuzz_wire", f"valid_handshake_wire{mode}", hello + challenge + proof + header + notice)


def varint(v):
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        out.append(byte | (0x80 if v else 0))
        if not v:
            return bytes(out)


def coo_payload(rows, row_bytes):
    gaps = b"".join(varint(r if i == 0 else r - rows[i - 1] - 1) for i, r in enumerate(rows))
    padded = gaps + bytes(-len(gaps) % 16)
    return gaps, padded + bytes(len(rows) * row_bytes)


def coo():
    rows = [0, 3, 200, 201, 70000]
    gaps, payload = coo_payload(rows, 2 * 4)
    header = struct.pack("<IIQQQQQQ", 0x434F4F31, 0, 100000, 2, len(rows), len(gaps), len(payload), 0)
    write("fuzz_coo", "five_rows_float32", header + payload)
    write("fuzz_coo", "empty", struct.pack("<IIQQQQQQ", 0x434F4F31, 0, 1, 1, 0, 0, 0, 0))


def coo_allreduce():
    # options, n, rowCount (2 bytes), rowElems, dtype; rank 0's tensor [nnz, rows (2 bytes each), values];
    # then per other rank [nnz, row steps (2 bytes each), values, corrupt (, its fields)].
    def tensor(rows, elems):
        return [len(rows)] + [b for r in rows for b in struct.pack("<H", r)] + [130 + i % 7 for i in range(len(rows) * elems)]
    head = lambda options, n, elems, dtype: [options, n - 2] + list(struct.pack("<H", 999)) + [elems, dtype]
    write("fuzz_coo_allreduce", "two_ranks_float64", head(0, 2, 2, 0) + tensor([5, 1, 5, 9], 2) + tensor([0, 3, 0], 2) + [0])
    write("fuzz_coo_allreduce", "three_ranks_float32_avg", head(2, 3, 2, 2) + tensor([4, 0], 2)
          + tensor([0, 2], 2) + [0] + tensor([9], 2) + [0])
    write("fuzz_coo_allreduce", "four_ranks_int32", head(0, 4, 1, 1) + tensor([7, 7, 2], 1)
          + tensor([1, 1], 1) + [0] + tensor([4], 1) + [0] + tensor([], 1) + [0])
    write("fuzz_coo_allreduce", "header_field_replaced", head(4, 3, 3, 2) + tensor([1, 2], 3)
          + tensor([2, 5], 3) + [0x11, 0x40] + tensor([3], 3) + [0])
    write("fuzz_coo_allreduce", "payload_bits", head(0, 2, 1, 3) + tensor([10], 1) + tensor([1, 2, 3], 1) + [0x80, 2, 5, 0, 3])
    write("fuzz_coo_allreduce", "raw_feed", head(1, 2, 1, 0) + tensor([1], 1) + [0x31, 0x4F, 0x4F, 0x43] + [0] * 60)


def sparse():
    # type byte, chunk (2 bytes), then a 16-byte header and payload.
    rel, values = [0, 5, 6], [1.0, -2.5, 3.0]
    gaps = varint(0) + varint(4) + varint(0)
    payload = gaps + struct.pack("<3f", *values)
    write("fuzz_sparse", "three_float32", [0, 16, 0] + list(struct.pack("<IIQ", 0, len(rel), len(payload)) + payload))
    dense = struct.pack("<4e", 1, 2, 3, 4)
    write("fuzz_sparse", "dense_float16", [1, 4, 0] + list(struct.pack("<IIQ", 1, 0, len(dense)) + dense))


def alltoall_splits():
    write("fuzz_alltoall_splits", "three_ranks", [4, 0, 6, 0, 4, 0, 1, 0, 2, 0, 3])
    write("fuzz_alltoall_splits", "wrapping_sum", [4, 33, 0xFF] * 4)


if __name__ == "__main__":
    frames()
    wire()
    coo()
    coo_allreduce()
    sparse()
    alltoall_splits()

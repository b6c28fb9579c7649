"""Element-wise reductions (csrc/kernels/cpu/reduce.*) through pycomm._C.kernels, on
every instruction set this CPU supports (kernels.set_cpu_isa forces one), against
torch references.

Tolerances (stated once): none. Every result must equal its reference bit for bit
(NaN compared as NaN, payload aside):
  * float32 / float64: torch.add / mul / minimum / maximum (IEEE, one rounding);
  * float16 / bfloat16: the op in float32, rounded once to the 16-bit type (round to
    nearest even), i.e. (a.float() op b.float()).to(dtype);
  * integers: torch's wrapping add / mul and bitwise ops; bool: SUM = OR, PRODUCT = AND;
  * every instruction set gives the same bits as the portable one.
Of -0.0 and +0.0, MIN / MAX keep the first operand (torch's own choice differs between
its scalar and vector loops), so the sign of a zero from MIN / MAX is checked against
that rule in its own test, not against torch.
"""
import pytest
import torch

from pycomm import _C

import loopback
from pycomm._C import kernels as K

ISAS = K.cpu_isas()
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
TORCH_OPS = {"sum": torch.add, "product": torch.mul, "min": torch.minimum,
             "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
             "bxor": torch.bitwise_xor}
# Tails of every vector width, and the 512-element blocks of the 16-bit path.
COUNTS = (0, 1, 3, 7, 8, 15, 16, 17, 31, 33, 63, 65, 511, 512, 513, 1025, 4099)


@pytest.fixture(params=ISAS)
def isa(request):
    K.set_cpu_isa(request.param)
    yield request.param
    K.set_cpu_isa("auto")


def reference(a, b, op):
    if op == "avg":
        op = "sum"
    if a.dtype == torch.bool:
        f = torch.logical_or if op in ("sum", "max", "bor") else (
            torch.logical_and if op in ("product", "min", "band") else torch.logical_xor)
        return f(a, b)
    if a.dtype in (torch.float16, torch.bfloat16):
        return TORCH_OPS[op](a.float(), b.float()).to(a.dtype)
    return TORCH_OPS[op](a, b)


def operands(dtype, count, seed, special=False):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (count,), generator=g).bool()
    if dtype.is_floating_point:
        x = (torch.randn(count, generator=g, dtype=torch.float64) * 50).to(dtype)
        if special and count >= 8:
            info = torch.finfo(dtype)
            picks = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                                  info.max, info.tiny / 2, -info.max], dtype=torch.float64)
            where = torch.randint(0, count, (max(1, count // 8),), generator=g)
            x[where] = picks[torch.randint(0, 8, where.shape, generator=g)].to(dtype)
        return x
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (count,), generator=g, dtype=torch.int64).to(dtype)


def assert_same(got, want, zero_sign=True):
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype.is_floating_point:
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok]), (got[ok] - want[ok]).abs().max()
        # -0.0 and +0.0 compare equal: check the sign bits too.
        if not zero_sign:
            ok &= want != 0
        assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))
    else:
        assert torch.equal(got, want)


def ops_for(dtype):
    if dtype == torch.bool:
        return ("sum", "product", "min", "max", "band", "bor", "bxor")
    if dtype.is_floating_point:
        return ("sum", "product", "min", "max")  # AVG: test_avg_divides_once
    return ("sum", "product", "min", "max", "band", "bor", "bxor")


def test_isa_list_and_default():
    assert ISAS[0] == "generic"
    assert set(ISAS) <= {"generic", "avx2", "avx512"}
    K.set_cpu_isa("auto")
    assert K.cpu_isa() == ISAS[-1]  # the widest supported is the default


@pytest.mark.parametrize("dtype", FLOATS + INTS + (torch.bool,), ids=str)
def test_every_dtype_op_and_count_matches_torch(isa, dtype):
    assert K.cpu_isa() == isa
    for op in ops_for(dtype):
        for count in COUNTS:
            a = operands(dtype, count, seed=count, special=True)
            b = operands(dtype, count, seed=count + 1000, special=True)
            dst = a.clone()
            K.reduce_into(dst, dst, b, op)
            assert_same(dst, reference(a, b, op), zero_sign=op not in ("min", "max"))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_every_16bit_pattern_round_trips(isa, dtype):
    # All 65536 bit patterns: x + 0 widens and narrows every value (-0 + 0 = +0),
    # x * 1 keeps -0; both through the vector and the scalar-tail conversions.
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    for op, other in (("sum", 0.0), ("product", 1.0), ("max", -float("inf"))):
        dst = x.clone()
        K.reduce_into(dst, dst, torch.full_like(x, other), op)
        assert_same(dst, reference(x, torch.full_like(x, other), op))


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
def test_16bit_rounding_is_round_to_nearest_even_once(isa, dtype):
    # Random pairs over the whole range (every exponent): sums and products of two
    # 16-bit values land on ties, subnormals and the overflow edge.
    g = torch.Generator().manual_seed(7)
    bits = lambda: torch.randint(-32768, 32768, (1 << 18,), generator=g,
                                 dtype=torch.int32).to(torch.int16).view(dtype)
    a, b = bits(), bits()
    for op in ("sum", "product", "min", "max"):
        dst = a.clone()
        K.reduce_into(dst, dst, b, op)
        assert_same(dst, reference(a, b, op), zero_sign=op not in ("min", "max"))
    if dtype == torch.float16:
        # 65504 + 16 ties between 65504 and 65536 and rounds to even (inf);
        # 65504 + 15 rounds down to 65504.
        a = torch.tensor([65504.0, 65504.0, -65504.0, 2.0 ** -24], dtype=dtype)
        b = torch.tensor([16.0, 8.0, -16.0, 2.0 ** -25], dtype=torch.float32)
        dst = a.clone()
        K.reduce_into(dst, dst, b.to(dtype), "sum")
        assert_same(dst, reference(a, b.to(dtype), "sum"))


def test_every_isa_gives_the_same_bits():
    results = {}
    for isa in ISAS:
        K.set_cpu_isa(isa)
        for dtype in FLOATS + INTS:
            for op in ("sum", "product", "min", "max"):
                a = operands(dtype, 3001, seed=1, special=True)
                dst = a.clone()
                K.reduce_into(dst, dst, operands(dtype, 3001, seed=2, special=True), op)
                results.setdefault((dtype, op), []).append(dst)
    K.set_cpu_isa("auto")
    for outs in results.values():
        for other in outs[1:]:
            assert_same(other, outs[0])


def test_integer_sum_and_product_wrap(isa):
    for dtype in INTS:
        info = torch.iinfo(dtype)
        a = torch.tensor([info.max, info.min, info.max, 3] * 5, dtype=dtype)
        b = torch.tensor([1, -1 if info.min < 0 else 1, info.max, 5] * 5, dtype=dtype)
        for op in ("sum", "product"):
            dst = a.clone()
            K.reduce_into(dst, dst, b, op)
            assert_same(dst, reference(a, b, op))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.int32), ids=str)
def test_three_operand_form(isa, dtype):
    for count in (0, 5, 17, 1030):
        a = operands(dtype, count, 3)
        b = operands(dtype, count, 4)
        want = reference(a, b, "max")
        a0, b0 = a.clone(), b.clone()
        out = torch.empty_like(a)
        K.reduce_into(out, a, b, "max")
        assert_same(out, want)
        assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs untouched
        K.reduce_into(a, a, b, "max")  # out is a
        assert_same(a, want)
        K.reduce_into(b0, a0, b0, "max")  # out is b: the operand order is kept
        assert_same(b0, want)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_min_max_nan_wins_and_ties_keep_the_first_operand(isa, dtype):
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([-0.0, 0.0, nan, 1.0, -inf, 2.0] * 5, dtype=dtype)
    b = torch.tensor([0.0, -0.0, 1.0, nan, 3.0, -inf] * 5, dtype=dtype)
    want = {"min": [-0.0, 0.0, nan, nan, -inf, -inf], "max": [-0.0, 0.0, nan, nan, 3.0, 2.0]}
    for op in ("min", "max"):
        expected = torch.tensor(want[op] * 5, dtype=dtype)
        out = torch.empty_like(a)
        K.reduce_into(out, a, b, op)
        assert_same(out, expected)
        dst = a.clone()
        K.reduce_into(dst, dst, b, op)
        assert_same(dst, expected)
        b2 = b.clone()
        K.reduce_into(b2, a, b2, op)  # out is the second operand: the order still holds
        assert_same(b2, expected)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_avg_divides_once(isa, dtype):
    # AVG through the loopback all-reduce: reduceInto sums, divideBy divides.
    n, count = 3, 1029
    inputs = [operands(dtype, count, seed=r) for r in range(n)]
    total = sum(t.double() for t in inputs)
    loopback.set_cpu_isa(isa)  # the harness has its own copy of the kernels
    try:
        out = loopback.collective("allreduce", [t.clone() for t in inputs], "avg", "ring", 0, 4096, 60.0)
    finally:
        loopback.set_cpu_isa("auto")
    # Each partial sum and the division round once in dtype: |error| <= 4 eps sum|x| / n.
    bound = 4 * torch.finfo(dtype).eps * sum(t.double().abs() for t in inputs) / n
    for t in out:
        assert ((t.double() - total / n).abs() <= bound).all()


def test_usage_errors():
    a = torch.zeros(8)
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        K.set_cpu_isa("sse9")
    with pytest.raises(ValueError, match="unknown op 'mean'"):
        K.reduce_into(a, a, a.clone(), "mean")
    with pytest.raises(TypeError, match="b is float64, the output is float32"):
        K.reduce_into(a, a, a.double())
    with pytest.raises(ValueError, match="b has 4 elements, the output has 8"):
        K.reduce_into(a, a, torch.zeros(4))
    with pytest.raises(ValueError, match="must be contiguous"):
        K.reduce_into(a, a, torch.zeros(16)[::2])
    with pytest.raises(ValueError, match="BAND is not supported for float32"):
        K.reduce_into(a, a, a.clone(), "band")
    with pytest.raises(ValueError, match="partially overlaps"):
        buf = torch.zeros(16)
        K.reduce_into(buf[1:9], buf[0:8], torch.zeros(8))
    assert K.cpu_isa() == ISAS[-1]  # a rejected name changes nothing


@pytest.mark.skipif("avx512" in ISAS, reason="this CPU supports every instruction set")
def test_unsupported_isa_is_refused():
    missing = next(i for i in ("avx2", "avx512") if i not in ISAS)
    with pytest.raises(ValueError, match=f"cannot run {missing}"):
        K.set_cpu_isa(missing)

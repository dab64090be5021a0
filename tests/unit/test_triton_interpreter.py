"""tests/triton_interpreter.py's memos give what Triton's interpreter itself gives: the numpy
dtype of every Triton type, and each 8-bit float conversion value for value (or its error)."""

from __future__ import annotations

import os

import numpy as np
import pytest

ti = pytest.importorskip("triton.runtime.interpreter")
tl = pytest.importorskip("triton.language")

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the memos are installed for the interpreter only")
FP8 = [tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]


def _originals():
    get_np_dtype, convert_float = ti._get_np_dtype, ti._convert_float
    assert hasattr(get_np_dtype, "__wrapped__") and hasattr(convert_float, "__wrapped__")
    return get_np_dtype.__wrapped__, convert_float.__wrapped__


def test_np_dtype_of_every_type():
    original, _ = _originals()
    for t in [tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
              tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, *FP8]:
        for tt in (t, tl.block_type(t, [4, 2]), tl.pointer_type(t),
                   tl.block_type(tl.pointer_type(t), [8])):
            assert ti._get_np_dtype(tt) == original(tt), tt


@pytest.mark.parametrize("src", FP8, ids=str)
def test_fp8_conversions_value_for_value(src):
    _, original = _originals()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(6, 8), dtype=np.uint8)
    for dst in [tl.float16, tl.bfloat16, tl.float32, tl.float64, *FP8]:
        for rounding in (None, ti._ir.ROUNDING_MODE.RTNE):
            for arg in (x, x[:, ::3], x[2, 5]):
                try:
                    want = original(arg, src, dst, rounding)
                except Exception as e:  # noqa: BLE001 (the memo must fail alike)
                    with pytest.raises(type(e)):
                        ti._convert_float(arg, src, dst, rounding)
                    continue
                got = ti._convert_float(arg, src, dst, rounding)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert np.array_equal(got, want), (src, dst, rounding)

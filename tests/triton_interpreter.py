"""Triton's interpreter without work it repeats: a test-run speed-up only, same results.

- Each call of a @triton.jit helper inside a kernel (`tl.sum`, `tl.sigmoid`, our own helpers
  such as `attend_kv_block`) makes the interpreter re-patch triton.language for that helper's
  module: an `inspect.getmembers` scan of tl, tl.core, tl.tensor and tl.math, about 0.6 ms a
  call and 20-30% of an interpreted kernel's time. Those patches are never undone, so within one
  launch a second patch of the same module finds everything patched already and changes nothing
  that matters. Here a helper's module is patched once per launch (the launch's own patch, which
  is undone after it, is left as it is).
- `_get_np_dtype` (a Triton dtype's numpy dtype, on every op) builds a 17-entry dict of Triton
  dtypes, hashing each, at every call: ~10% of an interpreted kernel. It is a pure function of
  the element type, kept here per type.
- `_convert_float` converts floats bit by bit in numpy (~0.7 ms a call, 7% of an FP8 kernel's
  time): an 8-bit input (e4m3 / e5m2 weights) has 256 values, so each (from, to, rounding)
  conversion is done once on all 256 and then looked up.
"""

from __future__ import annotations


def patch_once_per_launch() -> None:
    """Install the memos (no-op where the interpreter's layout is not the one known)."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:  # optional import: triton is a test dependency, guarded anyway
        return
    grid_call = vars(ti.GridExecutor).get("__call__")
    if (grid_call is None or "__call__" not in vars(ti.InterpretedFunction)
            or not all(hasattr(ti, f) for f in ("_patch_lang", "_get_np_dtype", "_convert_float"))
            or getattr(ti.InterpretedFunction, "_moeserve_patch_once", False)):
        return
    patched: set[int] = set()  # the globals of helpers already patched in the running launch

    def launch(self, *args, **kwargs):
        patched.clear()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.clear()

    def call_helper(self, *args, **kwargs):
        key = id(self.fn.__globals__)
        if key not in patched:
            ti._patch_lang(self.fn)
            patched.add(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = launch
    ti.InterpretedFunction.__call__ = call_helper
    ti.InterpretedFunction._moeserve_patch_once = True
    ti._get_np_dtype = _np_dtype_by_element(ti)
    ti._convert_float = _float8_by_table(ti)


def _np_dtype_by_element(ti):
    import numpy as np

    tl, original, by_type = ti.tl, ti._get_np_dtype, {}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = by_type.get(tt_dtype)
        if found is None:
            found = by_type[tt_dtype] = original(tt_dtype)
        return found

    get_np_dtype.__wrapped__ = original  # the tests compare against it
    return get_np_dtype


def _float8_by_table(ti):
    import numpy as np

    original, tables = ti._convert_float, {}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        key = (input_dtype, output_dtype, rounding_mode)
        if input_dtype.primitive_bitwidth == 8 and input.dtype.itemsize == 1:
            if key not in tables:
                try:  # elementwise: each value converts as it would among any others
                    tables[key] = original(np.arange(256, dtype=np.uint8), *key)
                except Exception:  # noqa: BLE001 (a value the original cannot convert: it says)
                    tables[key] = None
            if tables[key] is not None:
                return tables[key][np.asarray(input).view(np.uint8)].reshape(np.shape(input))
        return original(input, input_dtype, output_dtype, rounding_mode)

    convert_float.__wrapped__ = original
    return convert_float

"""Triton's interpreter without its repeated language patching: a test-run speed-up only.

Each call of a @triton.jit helper inside a kernel (`tl.sum`, `tl.sigmoid`, our own helpers such
as `attend_kv_block`) makes the interpreter re-patch triton.language for that helper's module:
an `inspect.getmembers` scan of tl, tl.core, tl.tensor and tl.math, about 0.6 ms a call and
20-30% of an interpreted kernel's time. Those patches are never undone, so within one launch a
second patch of the same module finds everything patched already and changes nothing that
matters. Here a helper's module is patched once per launch (the launch's own patch, which is
undone after it, is left as it is), so every kernel runs the same interpreted code as before.
"""

from __future__ import annotations


def patch_once_per_launch() -> None:
    """Install the per-launch memo (no-op where the interpreter's layout is not the one known)."""
    try:
        from triton.runtime import interpreter as ti
    except ImportError:  # optional import: triton is a test dependency, guarded anyway
        return
    grid_call = vars(ti.GridExecutor).get("__call__")
    if (grid_call is None or "__call__" not in vars(ti.InterpretedFunction)
            or not hasattr(ti, "_patch_lang")
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

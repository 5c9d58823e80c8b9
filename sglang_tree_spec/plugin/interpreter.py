"""SGLang's GPU kernels on a CPU, under Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter runs ``@triton.jit`` kernels on CPU tensors, one program instance at a time in
numpy, so a ``--device cpu --attention-backend triton`` server executes the very Triton kernels
(tree-masked extend attention, KV moves, slot writes) that SGLang launches on a GPU. It is for
testing: slow (about 0.75 s per decode step with a 2-layer model), exact.

One interpreter line needs a fix under numpy >= 2.3, and the plugin applies it with the same
``HookRegistry`` machinery as its SGLang hooks, only when the interpreter is on and numpy is that
new (nothing changes otherwise): :data:`HOOKS`, mirrored by an upstream-ready diff against
Triton in ``patches/triton-<TRITON_VERSION>/``.
"""

from __future__ import annotations

from typing import Any

from sglang_tree_spec.plugin.cpu import triton_interpreted
from sglang_tree_spec.plugin.hook import Hook

TRITON_VERSION = "3.6.0"  # torch 2.11.0's Triton, the one SGLang 0.5.17 runs with
NUMPY_WITHOUT_SIZE_ONE_INT = (2, 3)  # numpy releases from here refuse int() of a 1-element array


def index_of_a_size_one_array(original: Any, tensor: type, scope: Any) -> None:
    """AROUND hook on ``triton.runtime.interpreter._patch_lang_tensor``.

    While a kernel is interpreted every ``tl.tensor`` holds a numpy array, and a scalar is a
    1-element, 1-D array. The interpreter gives ``tl.tensor`` an ``__index__`` (used by
    ``range(start, tl.load(len_ptr), step)`` in a kernel, as SGLang's attention kernels loop
    over a request's KV) that calls ``int()`` on that array, which numpy >= 2.3 refuses
    (``TypeError: only 0-dimensional arrays can be converted to Python scalars``). Read the
    single element instead. Mirrored by
    ``patches/triton-3.6.0/0001-interpreter-index-of-a-size-one-array.diff``.
    """
    original(tensor, scope)
    scope.set_attr(tensor, "__index__", _element_as_int)


def _element_as_int(self: Any) -> int:
    return int(self.handle.data.item())


def _index_of_a_size_one_array() -> Any:
    return index_of_a_size_one_array


HOOKS: tuple[Hook, ...] = (
    Hook(
        target="triton.runtime.interpreter._patch_lang_tensor",
        kind="AROUND",
        make=_index_of_a_size_one_array,
        patch="0001-interpreter-index-of-a-size-one-array.diff",
        reason="the interpreter's tl.tensor.__index__ calls int() on a 1-element array, which "
        "numpy >= 2.3 refuses; SGLang's kernels loop up to a loaded length",
    ),
)
"""Hooks on Triton's interpreter; ``Hook.patch`` names a diff in ``patches/triton-3.6.0/``."""


def numpy_refuses_int_of_size_one_arrays() -> bool:
    """numpy >= 2.3 (``int(np.array([3]))`` raises)."""
    import numpy

    release = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    return release >= NUMPY_WITHOUT_SIZE_ONE_INT


def needed_hooks() -> tuple[Hook, ...]:
    """:data:`HOOKS` when kernels are interpreted here and numpy needs the fix, else none."""
    if triton_interpreted() and numpy_refuses_int_of_size_one_arrays():
        return HOOKS
    return ()

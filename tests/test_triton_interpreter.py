"""Triton's interpreter (``TRITON_INTERPRET=1``) runs SGLang's GPU kernels on CPU tensors.

The plugin's hook on the interpreter (sglang_tree_spec/plugin/interpreter.py): needed only under
the interpreter with numpy >= 2.3, applied through SGLang's ``HookRegistry``, mirrored by a diff
that applies to the installed Triton. A real kernel that loops up to a length it loads (as
SGLang's attention kernels loop over a request's KV) fails under numpy >= 2.3 without the hook
and runs with it. The served path is tests/test_sglang_triton_interpreter.py.
"""

from __future__ import annotations

import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from sglang_tree_spec.plugin import interpreter
from sglang_tree_spec.plugin.interpreter import HOOKS, TRITON_VERSION, needed_hooks

ROOT = Path(__file__).resolve().parents[1]
PATCH_DIR = ROOT / "patches" / f"triton-{TRITON_VERSION}"

# A kernel whose loop bound is a loaded scalar: ``range`` calls ``tl.tensor.__index__``.
KERNEL_SCRIPT = """
import sys
import torch
import triton
import triton.language as tl

if sys.argv[1] == "hooked":
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang_tree_spec.plugin.interpreter import needed_hooks

    hooks = needed_hooks()
    assert hooks, "the interpreter hook must be needed here"
    for hook in hooks:
        HookRegistry.register(hook.target, hook.make(), HookType[hook.kind])
    HookRegistry.apply_hooks()


@triton.jit
def sum_first_n(x_ptr, n_ptr, out_ptr):
    n = tl.load(n_ptr)
    total = tl.load(x_ptr) * 0
    for i in range(0, n):
        total += tl.load(x_ptr + i)
    tl.store(out_ptr, total)


x = torch.arange(10, dtype=torch.float32)
out = torch.zeros(1)
sum_first_n[(1,)](x, torch.tensor([4], dtype=torch.int32), out)
print("sum", float(out[0]))
"""


def run_kernel(mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run(
        [sys.executable, "-c", KERNEL_SCRIPT, mode],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_installed_triton_is_the_patched_release():
    assert triton.__version__ == TRITON_VERSION


def test_hook_is_needed_only_under_the_interpreter_with_new_numpy(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert needed_hooks() == ()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    expected = HOOKS if interpreter.numpy_refuses_int_of_size_one_arrays() else ()
    assert needed_hooks() == expected


def test_kernel_looping_to_a_loaded_length_needs_the_hook():
    """Without the hook the interpreter fails on numpy >= 2.3; with it, the sum is right."""
    new_numpy = interpreter.numpy_refuses_int_of_size_one_arrays()
    if new_numpy:
        plain = run_kernel("plain")
        assert plain.returncode != 0
        assert "only 0-dimensional arrays can be converted to Python scalars" in plain.stderr
    hooked = run_kernel("hooked" if new_numpy else "plain")
    assert hooked.returncode == 0, hooked.stderr[-3000:]
    assert "sum 6.0" in hooked.stdout  # 0 + 1 + 2 + 3


@pytest.mark.parametrize("hook", HOOKS, ids=lambda h: h.target)
def test_hook_target_exists_and_its_diff_applies_to_installed_triton(hook):
    module_path, _, attribute = hook.target.rpartition(".")
    assert attribute in vars(pkgutil.resolve_name(module_path)), hook.target
    diff = PATCH_DIR / hook.patch
    patch = shutil.which("patch")
    assert patch, "the `patch` tool is required (apt-get install patch)"
    site_packages = Path(triton.__file__).resolve().parents[1]
    result = subprocess.run(
        [patch, "--dry-run", "--batch", "-p2", "-d", str(site_packages), "-i", str(diff)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not re.search(r"fuzz|offset|FAILED", result.stdout), result.stdout
    assert f"`{hook.patch}`" in (ROOT / "patches" / "README.md").read_text()

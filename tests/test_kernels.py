"""The plugin's own Triton kernels (``plugin/kernels.py``) against the torch code they replace.

The kernel itself runs under Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess: the
interpreter is chosen when Triton is imported) with the plugin's interpreter hook applied, as on
an interpreted CPU server, in both tilings (a program a request as interpreted, a program a row
as on a GPU); the torch stand-in runs here. Both must write exactly what
:func:`~sglang_tree_spec.tree.layout.write_full_mask` writes, over batch sizes that are not
powers of two, windows of one slot and of a wide tree, empty and multi-chunk prefixes and a
buffer sized past the last block (host upper bounds), whose tail must read True.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sglang_tree_spec.plugin import kernels
from sglang_tree_spec.tree.layout import write_full_mask

# (bs, window, largest prefix, extra entries past the last block)
CASES = ((1, 1, 0, 0), (1, 9, 40, 0), (3, 9, 2100, 5), (7, 33, 1500, 3000), (16, 5, 0, 17))

SCRIPT = """
import sys
import torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_tree_spec.plugin.interpreter import needed_hooks

for hook in needed_hooks():
    HookRegistry.register(hook.target, hook.make(), HookType[hook.kind])
HookRegistry.apply_hooks()

sys.path.insert(0, sys.argv[1])
from test_kernels import CASES, check_full_mask
from sglang_tree_spec.plugin import kernels

assert kernels.runs_triton(torch.device("cpu"))
for one_program_a_request in (True, False):  # the interpreter's tiling, then the GPU's
    kernels._ONE_PROGRAM_A_REQUEST_INTERPRETED = one_program_a_request
    for case in CASES:
        check_full_mask(*case)
print("kernel ok", len(CASES))
"""


def check_full_mask(bs: int, window: int, max_prefix: int, extra: int) -> None:
    gen = torch.Generator().manual_seed(bs * 100 + window)
    tree_mask = torch.rand(bs, window, window, generator=gen) < 0.5
    prefix = torch.randint(0, max_prefix + 1, (bs,), generator=gen)
    size = int((window * (prefix + window)).sum()) + extra
    want = torch.zeros(size, dtype=torch.bool)
    write_full_mask(tree_mask, prefix, want)
    got = torch.zeros(size, dtype=torch.bool)  # (False: an entry the kernel skips shows)
    kernels.full_mask(tree_mask, prefix, got)
    assert torch.equal(got, want), (bs, window, max_prefix, extra)


def test_full_mask_kernel_writes_what_the_torch_mask_writes():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, tests],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and f"kernel ok {len(CASES)}" in done.stdout, done.stderr[-3000:]


def test_full_mask_stand_in_writes_what_the_torch_mask_writes(monkeypatch):
    monkeypatch.setattr(kernels, "runs_triton", lambda device: False)
    for case in CASES:
        check_full_mask(*case)


def test_each_full_mask_is_one_launch(monkeypatch):
    monkeypatch.setattr(kernels, "runs_triton", lambda device: False)
    launched: list[str] = []
    monkeypatch.setattr(kernels, "LAUNCHES", [launched.append])
    check_full_mask(2, 9, 30, 0)
    assert launched == ["full_mask"]


def test_a_kernel_that_fails_leaves_the_torch_mask(monkeypatch, caplog):
    def broken():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(kernels, "runs_triton", lambda device: True)
    monkeypatch.setattr(kernels, "_full_mask_kernel", broken)
    monkeypatch.setattr(kernels, "_FAILED", [])
    with caplog.at_level("WARNING"):
        check_full_mask(3, 9, 50, 4)
        check_full_mask(2, 5, 10, 0)
    assert kernels._FAILED == ["RuntimeError: no compiler"]
    assert caplog.text.count("tree-mask kernel failed") == 1

"""What one decode step costs the host and a GPU's launch queue, counted where no GPU is.

On a GPU a decode step is lean when it launches few kernels outside CUDA graphs, replays few
graphs and never waits for the device. A CPU runs the same code with no queue to wait on, so
:class:`StepAccounting` counts instead, per step:

* ``ops``: device ops dispatched outside graph replays (aten ops that would launch a kernel:
  views and bare allocations excluded);
* ``replays``: graph replays (a :meth:`StepAccounting.replay` region: a captured graph on CUDA,
  its closure on CPU, counted once whatever it runs);
* ``reads``: blocking host reads of device data (``.item()`` / ``int(t)``, ``.tolist()``,
  ``.cpu()``, ``.numpy()``, ``nonzero``, boolean indexing, ``unique``; a relayed wait such as
  SGLang's FutureMap host lengths, :meth:`StepAccounting.wait`), by site;
* ``uploads``: host-to-device copies of host data (:meth:`StepAccounting.upload`);
* ``cpu_only_ops`` / ``cpu_only_reads``: ops and reads of CPU stand-ins for what a GPU runs
  as one kernel (``cpu_only``: SGLang's non-CUDA branches, the plugin's CPU hooks);
* ``host_ms``: the step's wall time outside model forwards, replays and this counting's own
  bookkeeping (the dispatch of each op through the counter still adds a little).

Which tensors are on the device? On CPU every tensor is, so data is followed instead: a
tensor is *host* when it was marked so (:meth:`StepAccounting.mark_host`, e.g. SGLang's
``seq_lens_cpu``), built from Python data (``torch.tensor``), made by a factory without a
device argument, or computed from host tensors alone; every other tensor is device data (model
weights, KV pools, the scheduler's device tensors and everything computed from them). An op
with a device input is a device op; reading a host tensor is free.

Pure torch: no SGLang. ``plugin/accounting.py`` installs it in a server's scheduler.
"""

from __future__ import annotations

import collections
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

READ_OPS = frozenset(
    {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
     "unique_consecutive", "equal", "is_nonzero"}
)  # fmt: skip
# Ops that launch nothing: allocations, shape metadata and the lift of Python data.
FREE_OPS = frozenset(
    {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
     "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "set_"}
)  # fmt: skip
READ_METHODS = ("tolist", "cpu", "numpy")


@dataclass
class StepCounts:
    """One step's counts (see the module docstring)."""

    ops: int = 0
    replays: int = 0
    reads: int = 0
    uploads: int = 0
    cpu_only_reads: int = 0
    cpu_only_ops: int = 0
    host_ms: float = 0.0
    read_sites: collections.Counter = field(default_factory=collections.Counter)
    op_sites: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": self.ops,
            "replays": self.replays,
            "reads": self.reads,
            "uploads": self.uploads,
            "cpu_only_reads": self.cpu_only_reads,
            "cpu_only_ops": self.cpu_only_ops,
            "host_ms": round(self.host_ms, 3),
            "read_sites": dict(self.read_sites),
            "op_sites": dict(self.op_sites),
        }


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # meta / sparse / wrapper tensors
        return None


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten((args, kwargs))
    return [value for value in flat if isinstance(value, torch.Tensor)]


def _site(package: str, cpu_only: tuple = ()) -> tuple[str, bool]:
    """``file:line`` of the innermost frame outside torch, and of the innermost frame in
    ``package`` when that is another one (``sglang/... (from plugin/...)``); and whether any
    frame is one of ``cpu_only``'s ``(path suffix, function name or None)``."""
    frames = [
        f
        for f in traceback.extract_stack()
        if "/torch/" not in f.filename and f.filename != __file__
    ]
    if not frames:
        return "?", False
    stand_in = any(
        f.filename.endswith(path) and name in (None, f.name)
        for f in frames
        for path, name in cpu_only
    )
    ours = next((f for f in reversed(frames) if _ours(f, package)), None)
    inner = _short(frames[-1], package)
    if ours is None or ours is frames[-1]:
        return inner, stand_in
    return f"{inner} (from {_short(ours, package)})", stand_in


def _function(package: str) -> str:
    """``file:function`` of the innermost frame in ``package`` (else the innermost one outside
    torch): where an op comes from, for the per-step breakdown."""
    frames = [
        f
        for f in traceback.extract_stack()
        if "/torch/" not in f.filename and f.filename != __file__
    ]
    if not frames:
        return "?"
    ours = next((f for f in reversed(frames) if _ours(f, package)), None)

    def name(frame: traceback.FrameSummary) -> str:
        return f"{_short(frame, package).rsplit(':', 1)[0]}:{frame.name}"

    if ours is None or ours is frames[-1]:
        return name(ours or frames[-1])
    return f"{name(ours)} > {name(frames[-1])}"


def _ours(frame: traceback.FrameSummary, package: str) -> bool:
    """A frame of ``package``'s own code (its accounting hooks are not a site)."""
    return f"/{package}/" in frame.filename and not frame.filename.endswith("/plugin/accounting.py")


def _short(frame: traceback.FrameSummary, package: str) -> str:
    path = frame.filename
    for root in (f"/{package}/", "/site-packages/"):
        if root in path:
            path = path.rsplit(root, 1)[1]
            break
    return f"{path}:{frame.lineno}"


class _Dispatch(TorchDispatchMode):
    def __init__(self, accounting: StepAccounting) -> None:
        super().__init__()
        self.accounting = accounting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        start = time.perf_counter()
        accounting = self.accounting
        accounting._dispatched(func, args, kwargs, out)
        if not accounting._quiet:  # (a replay's whole time is excluded already)
            accounting._excluded += time.perf_counter() - start  # the counting's own time
        return out


class StepAccounting:
    """Counts per step while :meth:`step` is open (one at a time; see the module docstring).

    ``package``: the code whose sites are named in ``read_sites`` / ``op_sites`` (the frame of
    that package nearest the op), e.g. ``"sglang_tree_spec"``.
    """

    def __init__(
        self, package: str = "sglang_tree_spec", sites: bool = True, cpu_only: tuple = ()
    ) -> None:
        self.package, self.sites = package, sites
        # (path suffix, function or None) of CPU stand-ins for GPU kernels (code a GPU does
        # not run): their ops and reads are counted apart (``cpu_only_ops`` / ``_reads``).
        self.cpu_only = cpu_only
        self.current: StepCounts | None = None
        self._host: set[int] = set()
        self._quiet = 0  # > 0: inside a replay or a counted wait (nothing else is counted)
        self._excluded = 0.0  # seconds of this step inside forwards and replays
        self._mode: _Dispatch | None = None
        self._saved: dict[str, Any] = {}

    # --- the step -----------------------------------------------------------------------

    @contextmanager
    def step(self, host_tensors: list[torch.Tensor] = ()) -> Iterator[StepCounts]:
        """Count one step; ``host_tensors``: tensors made before the step that are host data."""
        counts = StepCounts()
        self.current, self._excluded, self._quiet = counts, 0.0, 0
        self._host = set()
        self.mark_host(*host_tensors)
        self._patch_methods()
        self._mode = _Dispatch(self)
        start = time.perf_counter()
        try:
            with self._mode:
                yield counts
        finally:
            counts.host_ms = 1e3 * (time.perf_counter() - start - self._excluded)
            self._unpatch_methods()
            self.current, self._mode = None, None

    def mark_host(self, *tensors: torch.Tensor | None) -> None:
        """These tensors hold host data (a CPU mirror, a pinned staging buffer)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key is not None:
                    self._host.add(key)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """A graph replay: counted once, nothing inside it counted, its time excluded."""
        counts = self.current
        if counts is None or self._quiet:
            yield
            return
        counts.replays += 1
        start = time.perf_counter()
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1
            self._excluded += time.perf_counter() - start

    @contextmanager
    def forward(self) -> Iterator[None]:
        """An eager model forward: its ops are counted, its time is not host time."""
        start, excluded = time.perf_counter(), self._excluded
        try:
            yield
        finally:
            if self.current is not None and not self._quiet:  # (its counting already is)
                self._excluded = excluded + time.perf_counter() - start

    @contextmanager
    def wait(self, site: str) -> Iterator[None]:
        """A blocking wait for the device (one read at ``site``); reads inside it are its own."""
        counts = self.current
        if counts is None or self._quiet:
            yield
            return
        counts.reads += 1
        counts.read_sites[site] += 1
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def launch(self, kernel: str) -> None:
        """One launch of the package's own kernel (its torch stand-in's ops are not counted)."""
        if self.current is not None and not self._quiet:
            self.current.ops += 1
            self.current.op_sites[f"kernel:{kernel}"] += 1

    def upload(self) -> None:
        """A host-to-device copy of host data."""
        if self.current is not None and not self._quiet:
            self.current.uploads += 1

    def mark_device(self, *tensors: torch.Tensor | None) -> None:
        """These tensors hold device data (an upload's result)."""
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                self._host.discard(_storage_key(tensor))

    def is_host(self, tensor: torch.Tensor) -> bool:
        return _storage_key(tensor) in self._host

    # --- dispatch -----------------------------------------------------------------------

    def _dispatched(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        counts = self.current
        if counts is None:
            return
        name = func.__name__.split(".")[0]
        if name == "lift_fresh":  # torch.tensor(python data)
            self.mark_host(out)
            return
        inputs = _tensors(args, kwargs)
        written = [
            value
            for argument, value in zip(func._schema.arguments, args, strict=False)
            if isinstance(value, torch.Tensor)
            and argument.alias_info is not None
            and argument.alias_info.is_write
        ]
        if inputs:
            device_op = any(not self.is_host(t) for t in inputs)
        else:  # a factory: device data when it names a device
            device_op = kwargs.get("device") is not None
        # A tensor keeps where it lives when written; a new result lives with its inputs.
        kept = {_storage_key(t) for t in written}
        for tensor in _tensors(out, {}) if not isinstance(out, torch.Tensor) else [out]:
            key = _storage_key(tensor)
            if key is None or key in kept:
                continue
            if device_op:
                self._host.discard(key)  # (an address a freed host tensor had)
            else:
                self._host.add(key)
        if self._quiet or not device_op:
            return
        if name == "copy_" and len(args) > 1:  # host <-> device copies
            dst_host, src_host = self.is_host(args[0]), self.is_host(args[1])
            if dst_host and not src_host:
                if not (len(args) > 2 and args[2]) and not kwargs.get("non_blocking"):
                    self._read(counts)
                return
            if src_host and not dst_host:
                counts.uploads += 1
        if name in READ_OPS:
            self._read(counts)
        elif not func.is_view and name not in FREE_OPS:
            if self.cpu_only and _site(self.package, self.cpu_only)[1]:
                counts.cpu_only_ops += 1  # (one kernel of SGLang's on a GPU)
                return
            counts.ops += 1
            if self.sites:
                counts.op_sites[_function(self.package)] += 1

    def _read(self, counts: StepCounts) -> None:
        site, stand_in = _site(self.package, self.cpu_only) if self.sites else ("?", False)
        if stand_in:
            counts.cpu_only_reads += 1
            return
        counts.reads += 1
        counts.read_sites[site] += 1

    # --- Python-level reads ---------------------------------------------------------------

    def _patch_methods(self) -> None:
        for method in READ_METHODS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor: torch.Tensor, *args: Any, _original=original, **kwargs: Any):
                counts = self.current
                if counts is not None and not self._quiet and not self.is_host(tensor):
                    self._read(counts)
                    result = _original(tensor, *args, **kwargs)
                    if isinstance(result, torch.Tensor):
                        if _storage_key(result) == _storage_key(tensor):
                            self._quiet += 1  # on CPU .cpu() aliases: a GPU returns a copy
                            try:
                                result = result.clone()
                            finally:
                                self._quiet -= 1
                        self.mark_host(result)
                    return result
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)

    def _unpatch_methods(self) -> None:
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        self._saved = {}


def summarize(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Per-step means of a list of :meth:`StepCounts.as_dict` records."""
    if not steps:
        return {}
    keys = ("ops", "replays", "reads", "uploads", "host_ms")
    return {key: sum(step[key] for step in steps) / len(steps) for key in keys}

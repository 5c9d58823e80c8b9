"""Step accounting in a server's scheduler (``SGLANG_TREE_SPEC_ACCOUNTING=DIR``; diagnostics).

With the variable set, every decode batch the scheduler runs (``Scheduler.run_batch``: the
FutureMap's host lengths, the worker's whole step) is counted by
:class:`~sglang_tree_spec.accounting.StepAccounting` and one JSON line a step is appended to
``DIR/steps_<pid>.jsonl``: the batch size, the algorithm and the counts (on CUDA also
``cuda_syncs``, the synchronising calls torch's sync debug mode reports). It counts any
algorithm the same way (none, SGLang's DFLASH, DDTREE), which is what
``benchmarks/step_accounting.py`` compares.

A CPU has no CUDA graphs, so what a GPU would replay is stated here, as SGLang's runners do
on CUDA (:func:`replays_on_cuda`): the target's decode forward (SGLang's decode graphs), the
target verify and the drafter block of SGLang's DFLASH (its verify graphs and its captured
draft), and DDTREE's own verify and tree-build graphs (their closure replay,
``SGLANG_TREE_SPEC_CPU_VERIFY_GRAPHS=1``). DDTREE's drafter forward is eager on CUDA (its
draft runner captures no decode graph), so its ops are counted one by one.

These hooks change no behaviour (they count and time only; one lets SGLang's DFLASH start on a
CPU, where it refuses to, so that it is counted too), so they have no upstream diff in
``patches/``; their targets are declared with the others (``compat.INTERNALS``). Off (the
variable unset) nothing is registered.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from sglang_tree_spec.accounting import StepAccounting

ACCOUNTING_ENV = "SGLANG_TREE_SPEC_ACCOUNTING"
TARGETS = (
    "sglang.srt.managers.scheduler.Scheduler.run_batch",
    "sglang.srt.managers.overlap_utils.FutureMap.resolve_seq_lens_cpu",
    "sglang.srt.model_executor.model_runner.ModelRunner.forward",
    "sglang.srt.arg_groups.speculative_hook._handle_dflash",
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
    "sglang.srt.speculative.dflash_worker_v2.assign_extend_cache_locs_func",
)
# Code a GPU does not run, each call one kernel there: the plugin's CPU stand-ins for SGLang's
# kernels and for its own (each launch of its own counted as one op: ``_wrap_launches``),
# SGLang's native KV move (CUDA: a Triton kernel) and the non-CUDA branch of its drafter
# context write (CUDA: a tiled Triton kernel), and this module's DFLASH slot gather.
CPU_ONLY_SITES = (
    ("sglang_tree_spec/plugin/cpu.py", None),
    ("sglang/srt/mem_cache/memory_pool.py", "move_kv_cache_native"),
    ("sglang/srt/mem_cache/memory_pool.py", "set_kv_buffer_prefix_valid"),
    ("sglang_tree_spec/plugin/accounting.py", "_extend_cache_locs_on_cpu"),
    ("sglang_tree_spec/plugin/kernels.py", "_full_mask_stand_in"),
)
_accounting: StepAccounting | None = None


def requested() -> bool:
    return bool(os.environ.get(ACCOUNTING_ENV))


def register() -> None:
    """Register the counting hooks (SGLang applies them with the plugin's others)."""
    global _accounting
    if not requested() or _accounting is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    Path(os.environ[ACCOUNTING_ENV]).mkdir(parents=True, exist_ok=True)
    _accounting = StepAccounting("sglang_tree_spec", cpu_only=CPU_ONLY_SITES)
    hooks = (
        _run_batch, _resolve_seq_lens_cpu, _forward, _dflash_on_cpu, _dflash_step_on_cpu,
        _extend_cache_locs_on_cpu,
    )  # fmt: skip
    for target, hook in zip(TARGETS, hooks, strict=True):
        HookRegistry.register(target, hook, HookType.AROUND)
    _wrap_own_replays(_accounting)
    _wrap_uploads(_accounting)
    _wrap_launches(_accounting)


def _algorithm(server_args: Any) -> str:
    return str(getattr(server_args, "speculative_algorithm", None) or "NONE").upper()


def replays_on_cuda(model_runner: Any, forward_batch: Any) -> bool:
    """Whether SGLang replays this model forward from a CUDA graph on a GPU (see the module
    docstring): decode forwards of a target, and DFLASH's target verify and drafter block."""
    mode = forward_batch.forward_mode
    algorithm = _algorithm(model_runner.server_args)
    if mode.is_decode():
        return not model_runner.is_draft_worker
    if mode.is_target_verify():  # a drafter block (DFLASH's, DDTREE's) or DFLASH's verify
        # (DDTREE's target verify graphs are counted where they replay: replay_shape)
        return model_runner.is_draft_worker or algorithm == "DFLASH"
    return False


def _host_mirrors(*objects: Any) -> list[torch.Tensor]:
    """Tensors held under a name with ``cpu`` in it: SGLang's host mirrors (``seq_lens_cpu``,
    ``reserved_seq_lens_cpu``, pinned staging buffers), host data on a GPU too."""
    found = []
    for obj in objects:
        for name, value in getattr(obj, "__dict__", {}).items():
            if "cpu" in name and isinstance(value, torch.Tensor):
                found.append(value)
    return found


def _run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    if _accounting is None or not batch.forward_mode.is_decode():
        return original(scheduler, batch, *args, **kwargs)
    worker = getattr(scheduler, "model_worker", None)
    graphs = getattr(worker, "verify_graphs", None)
    mirrors = _host_mirrors(
        batch, batch.spec_info, getattr(scheduler, "future_map", None), worker,
        getattr(worker, "_draft_worker", None), getattr(graphs, "buffers", None),
    )  # fmt: skip
    with _accounting.step(mirrors) as counts, _cuda_syncs(batch) as syncs:
        result = original(scheduler, batch, *args, **kwargs)
    record = {
        "pid": os.getpid(),
        "algorithm": _algorithm(scheduler.server_args),
        "bs": len(batch.reqs),
        "overlap": bool(getattr(scheduler, "enable_overlap", False)),
        "tokens": _committed(result, len(batch.reqs)),
        "cuda_syncs": len(syncs),
        **counts.as_dict(),
    }
    path = Path(os.environ[ACCOUNTING_ENV]) / f"steps_{os.getpid()}.jsonl"
    with path.open("a") as out:
        out.write(json.dumps(record) + "\n")
    return result


@contextmanager
def _cuda_syncs(batch: Any) -> Iterator[list]:
    """On CUDA, the step's synchronising calls as torch reports them
    (``torch.cuda.set_sync_debug_mode``): the device's own count of blocking reads."""
    syncs: list = []
    device = getattr(batch.seq_lens, "device", None)
    if device is None or device.type != "cuda":
        yield syncs
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    syncs.extend(w for w in caught if "synchroniz" in str(w.message))


def _committed(result: Any, bs: int) -> int:
    """Tokens the step committed over its requests (read after the step, not counted)."""
    accept_lens = getattr(result, "accept_lens", None)
    return bs if accept_lens is None else int(accept_lens.sum())


def _resolve_seq_lens_cpu(original: Any, future_map: Any, batch: Any) -> Any:
    """SGLang's relay of host lengths waits for the previous step's publish (a CUDA event, or
    ``.cpu()`` where there is no side stream): one blocking read when relayed."""
    info = batch.spec_info
    relayed = (
        _accounting is not None
        and bool(getattr(future_map, "needs_cpu_seq_lens", False))
        and getattr(info, "future_indices", None) is not None
    )
    if not relayed:
        return original(future_map, batch)
    with _accounting.wait("FutureMap host lengths"):
        result = original(future_map, batch)
    _accounting.mark_host(batch.seq_lens_cpu)
    return result


def _forward(original: Any, model_runner: Any, forward_batch: Any, *args: Any, **kwargs: Any):
    if _accounting is None or _accounting.current is None:
        return original(model_runner, forward_batch, *args, **kwargs)
    region = _accounting.replay() if replays_on_cuda(model_runner, forward_batch) else None
    with region if region is not None else _accounting.forward():
        return original(model_runner, forward_batch, *args, **kwargs)


def _dflash_on_cpu(original: Any, server_args: Any) -> Any:
    """SGLang's DFLASH refuses a CPU device at start-up; counted, it is the row to beat, so
    with accounting on its argument handling runs as for CUDA (the device is shown as CUDA to
    that check alone). Only under ``SGLANG_TREE_SPEC_ACCOUNTING``."""
    if server_args.device != "cpu":
        return original(server_args)
    server_args.device = "cuda"
    try:
        return original(server_args)
    finally:
        server_args.device = "cpu"


def _dflash_step_on_cpu(original: Any, worker: Any, *args: Any, **kwargs: Any) -> Any:
    """DFLASH's step records its lengths' stream, which CPU tensors refuse: skipped on CPU."""
    from sglang_tree_spec.plugin.cpu import no_stream_record_on_cpu

    if worker.device != "cpu":
        return original(worker, *args, **kwargs)
    with no_stream_record_on_cpu():
        return original(worker, *args, **kwargs)


def _extend_cache_locs_on_cpu(original: Any, req_pool_indices: Any, req_to_token: Any,
                              start_offset: Any, end_offset: Any, batch_size: int,
                              draft_token_num: int, device: Any) -> Any:  # fmt: skip
    """DFLASH's block slots (one Triton kernel on CUDA; SGLang has no CPU path): the
    ``draft_token_num`` slots from ``start_offset`` of each request's row, ``[bs * n]``."""
    if torch.device(req_to_token.device).type != "cpu":
        return original(req_pool_indices, req_to_token, start_offset, end_offset, batch_size,
                        draft_token_num, device)  # fmt: skip
    columns = start_offset.to(torch.int64)[:, None] + torch.arange(draft_token_num)
    return req_to_token[req_pool_indices.to(torch.int64)[:, None], columns].flatten().long()


def _wrap_own_replays(accounting: StepAccounting) -> None:
    """DDTREE's verify and tree-build graphs: their replay is one launch."""
    from sglang_tree_spec.plugin.graphs import DDTreeVerifyGraphs
    from sglang_tree_spec.tree.graphs import TreeGraphs

    for cls in (DDTreeVerifyGraphs, TreeGraphs):
        replay = cls.replay_shape

        def counted(self: Any, *args: Any, _replay=replay, **kwargs: Any) -> Any:
            with accounting.replay():
                return _replay(self, *args, **kwargs)

        cls.replay_shape = counted


def _wrap_uploads(accounting: StepAccounting) -> None:
    """The plugin's host-to-device copies (``host_copy.to_device``: pinned, not blocking)."""
    from sglang_tree_spec import host_copy

    def uploaded(result: torch.Tensor) -> None:
        accounting.upload()
        accounting.mark_device(result)

    host_copy.OBSERVERS.append(uploaded)


def _wrap_launches(accounting: StepAccounting) -> None:
    """The plugin's own kernels (``plugin/kernels.py``): one op a launch."""
    from sglang_tree_spec.plugin import kernels

    kernels.LAUNCHES.append(accounting.launch)

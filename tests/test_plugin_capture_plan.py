"""DDTREE's capture plan (``plugin/capture_plan.py``) under SGLang's defaults, beside DFLASH's.

A user adds the DDTREE flags to the launch line they run on an H200 (141 GiB) or an H100
(80 GiB) and changes nothing else. SGLang then captures decode graphs at up to 51 batch sizes
(its speculative list up to 256, chosen by device memory) and DDTREE one verify graph per batch
size and budget. The batch sizes here are SGLang's own: real ``ServerArgs`` resolution for the
Llama-3.1-8B-shaped pair (configs only, ``models/shaped_pair.py``) on ``--device cuda`` with the
device memory mocked. Asserted: the plan (static inputs, tree mask, one shared set of logits and
hidden-state outputs, the graph pool's LM-head output) fits in ``CAPTURE_SHARE`` of memory at
every default capture size; with a wider window the speculation cap is the largest batch size
that fits. Each plan is printed beside DFLASH's (its decode graph runner at the drafter's
block, SGLang's default 48 running requests). About 40 s (four resolutions).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import test_plugin_registration

from sglang_tree_spec.config import TreeConfig
from sglang_tree_spec.control import MODEL_SHAPES
from sglang_tree_spec.models.shaped_pair import MAX_POSITIONS, drafter_config, target_config
from sglang_tree_spec.plugin import compat
from sglang_tree_spec.plugin.capture_plan import (
    CAPTURE_SHARE,
    FLASHINFER_WRAPPER_BYTES,
    FLASHINFER_WRAPPER_PINNED_BYTES,
    GIB,
    dflash_plan,
    kept_wrapper_bytes,
    speculation_cap,
    verify_plan,
)

sglang_plugins = test_plugin_registration.sglang_plugins

SHAPE = MODEL_SHAPES["llama-3.1-8b"]
BLOCK = 16  # the shaped pair's drafter block: DDTREE's default window
TARGET_LAYERS = [1, SHAPE.layers - 2]  # the shaped pair's drafter reads two target layers
DEVICES_GIB = {"H200": 141, "H100": 80}
LLAMA_CONTEXT = 131072  # Llama-3.1-8B's own context (the shaped pair's is MAX_POSITIONS)


@pytest.fixture(scope="module")
def shaped_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The 8B-shaped target and drafter, configs only (resolution reads nothing else)."""
    root = tmp_path_factory.mktemp("shaped-8b")
    configs = {
        "target": target_config(SHAPE),
        "drafter": drafter_config(SHAPE, 1, BLOCK, TARGET_LAYERS),
    }
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return {name: str(root / name) for name in configs}


def resolve_on_device(configs: dict[str, str], algorithm: str, gib: int) -> Any:
    """SGLang's resolved defaults for ``algorithm`` on a CUDA device of ``gib`` GiB."""
    from sglang.srt import server_args as sa

    mib = gib * 1024  # SGLang reads device memory in MiB
    with pytest.MonkeyPatch.context() as patch:
        if compat.is_release("0.5.17"):
            patch.setattr(sa, "get_device_memory_capacity", lambda device=None: mib)
        else:
            from sglang.srt.arg_groups import kv_shard_hook, memory_hook

            for module in (memory_hook, kv_shard_hook):
                patch.setattr(module, "get_device_memory_capacity", lambda device=None: mib)
        args = sa.ServerArgs(
            model_path=configs["target"],
            device="cuda",
            speculative_algorithm=algorithm,
            speculative_draft_model_path=configs["drafter"],
        )
        return compat.resolved(compat.resolve(args))


@pytest.fixture(scope="module")
def defaults(sglang_plugins, shaped_configs) -> dict[str, dict[str, Any]]:
    """Per device: SGLang's decode capture sizes and DDTREE's window under DDTREE, and DFLASH's
    capture sizes (its list up to its default running requests)."""
    found = {}
    for device, gib in DEVICES_GIB.items():
        ddtree = resolve_on_device(shaped_configs, "DDTREE", gib)
        dflash = resolve_on_device(shaped_configs, "DFLASH", gib)
        dflash_bs = [
            b for b in dflash.cuda_graph_config.decode.bs if b <= dflash.max_running_requests
        ]
        found[device] = {
            "gib": gib,
            "batch_sizes": list(ddtree.cuda_graph_config.decode.bs),
            "window": int(ddtree.speculative_num_draft_tokens),
            "dflash_batch_sizes": dflash_bs,
            "dflash_block": int(dflash.speculative_num_draft_tokens),
        }
    return found


def shape_of(window: int, context: int = MAX_POSITIONS) -> dict[str, int]:
    """The plan's model inputs; a ``req_to_token`` row is the context plus DDTREE's decode
    reservation (4 + twice the window: ``server_args.req_to_token_headroom``)."""
    return {
        "vocab": SHAPE.vocab,
        "hidden_width": SHAPE.hidden * len(TARGET_LAYERS),
        "max_context": context + 4 + 2 * window,
        "dtype_bytes": 2,  # bfloat16
    }


def budgets_of(window: int) -> tuple[int, ...]:
    """The budgets DDTREE's default budget control captures for a window."""
    return TreeConfig(budget=window - 1, auto=True).budgets


def report(device: str, found: dict[str, Any], plan: Any, cap: int) -> None:
    dflash = dflash_plan(
        found["dflash_batch_sizes"],
        found["dflash_block"],
        vocab=SHAPE.vocab,
        hidden_width=SHAPE.hidden * len(TARGET_LAYERS),
        dtype_bytes=2,
    )
    print(f"\n{device} ({found['gib']} GiB), {SHAPE.name}:")
    print(f"  DDTREE {plan.line()}; speculation cap {cap}")
    print(f"  DFLASH {dflash.line()}")


@pytest.mark.parametrize("device", DEVICES_GIB)
@pytest.mark.parametrize("context", [MAX_POSITIONS, LLAMA_CONTEXT], ids=["8k", "128k"])
def test_the_default_plan_fits_at_every_default_capture_size(defaults, device, context):
    found = defaults[device]
    sizes, window = found["batch_sizes"], found["window"]
    assert window == BLOCK and max(sizes) == 256 and len(sizes) == 51  # SGLang's defaults
    budgets = budgets_of(window)
    plan = verify_plan(sizes, budgets, **shape_of(window, context))
    memory = found["gib"] * GIB
    cap = speculation_cap(budgets, memory, **shape_of(window, context))
    report(device, found, plan, cap)
    assert plan.shapes == len(sizes) * len(budgets)
    assert plan.total <= CAPTURE_SHARE * memory
    assert cap >= max(sizes)  # nothing is left out of the capture at the default window


@pytest.mark.parametrize("device", DEVICES_GIB)
@pytest.mark.parametrize("window", [33, 65], ids=["budget-32", "budget-64"])
def test_a_wider_window_is_capped_where_it_would_not_fit(defaults, device, window):
    """``--speculative-num-draft-tokens 33`` (the README's launch line) or 65: the cap is the
    largest batch size whose plan fits; the verify graphs capture SGLang's sizes up to it."""
    found = defaults[device]
    memory, budgets, shape = found["gib"] * GIB, budgets_of(window), shape_of(window)
    cap = speculation_cap(budgets, memory, **shape)
    captured = [b for b in found["batch_sizes"] if b <= cap]
    plan = verify_plan(captured, budgets, **shape)
    report(device, found, plan, cap)
    assert captured and plan.total <= CAPTURE_SHARE * memory
    assert verify_plan([cap + 1], budgets, **shape).total > CAPTURE_SHARE * memory
    assert verify_plan([cap], budgets, **shape).total <= CAPTURE_SHARE * memory


@pytest.mark.parametrize("device", DEVICES_GIB)
def test_flashinfer_wrappers_kept_per_shape_lower_the_cap_where_they_do_not_fit(defaults, device):
    """With ``--attention-backend flashinfer`` every shape keeps its wrappers (each an 8 MiB
    device workspace and a pinned host copy): at SGLang's defaults the plan counts them, and
    the cap is the largest batch size whose shapes up to it fit (an H200 still captures every
    default size, an H100 not)."""
    found = defaults[device]
    sizes, window = found["batch_sizes"], found["window"]
    memory, budgets = found["gib"] * GIB, budgets_of(window)
    shape = {**shape_of(window, LLAMA_CONTEXT), "wrapper_bytes": kept_wrapper_bytes(True)}
    cap = speculation_cap(budgets, memory, batch_sizes=sizes, **shape)
    captured = [b for b in sizes if b <= cap]
    plan = verify_plan(captured, budgets, **shape)
    report(device, found, plan, cap)
    assert plan.wrappers == plan.shapes * FLASHINFER_WRAPPER_BYTES > GIB
    assert plan.pinned == plan.shapes * FLASHINFER_WRAPPER_PINNED_BYTES
    assert plan.total <= CAPTURE_SHARE * memory
    wider = verify_plan([*captured, cap + 1], budgets, **shape)
    assert wider.total > CAPTURE_SHARE * memory
    assert (cap >= max(sizes)) == (device == "H200")  # an H100 speculates up to 192 here


def test_the_cap_is_zero_when_one_request_does_not_fit():
    shape = {"vocab": 1 << 20, "hidden_width": 1 << 14, "max_context": 1 << 20, "dtype_bytes": 2}
    assert speculation_cap((0, 1024), 8 * GIB, **shape) == 0
    assert verify_plan([], (0, 4), **shape).total == 0


def test_one_output_set_serves_every_shape():
    """The logits and hidden states are sized by the largest shape, whatever the number of
    shapes: adding smaller batch sizes or budgets adds no output memory."""
    shape = shape_of(BLOCK)
    one = verify_plan([256], (15,), **shape)
    many = verify_plan(range(1, 257), (0, 4, 8, 15), **shape)
    assert (many.logits, many.hidden, many.mask) == (one.logits, one.hidden, one.mask)
    assert one.logits == 4 * 256 * BLOCK * SHAPE.vocab

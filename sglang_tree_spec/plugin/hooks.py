"""Every change the plugin makes to SGLang's behaviour, as ``HookRegistry`` hooks.

One hook per reason; each is mirrored by an upstream-ready diff in ``patches/sglang-<ver>/``
(tests dry-run every diff against the installed SGLang and check every target exists).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SGLANG_VERSION = "0.5.17"


@dataclass(frozen=True)
class Hook:
    """One ``HookRegistry`` registration and the diff that makes it unnecessary upstream."""

    target: str  # dotted path in SGLang
    kind: str  # HookType member name: BEFORE / AFTER / AROUND / REPLACE
    make: Callable[[], Any]  # returns the hook callable or class (imported lazily)
    patch: str  # file name under patches/sglang-<SGLANG_VERSION>/
    reason: str


def _ddtree_server_args() -> type:
    from sglang_tree_spec.plugin.server_args import DDTreeServerArgs

    return DDTreeServerArgs


def _native_rotary_on_cpu() -> Callable[..., None]:
    from sglang_tree_spec.plugin.cpu import native_rotary_on_cpu

    return native_rotary_on_cpu


HOOKS: tuple[Hook, ...] = (
    Hook(
        target="sglang.srt.server_args.ServerArgs",
        kind="REPLACE",
        make=_ddtree_server_args,
        patch="0001-server-args-ddtree-flags.diff",
        reason="add the --speculative-ddtree-* fields (CLI, Engine kwargs, config bags)",
    ),
    Hook(
        target="sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__",
        kind="BEFORE",
        make=_native_rotary_on_cpu,
        patch="0002-rotary-native-on-cpu.diff",
        reason="--device cpu without SGLANG_USE_CPU_ENGINE must not import vllm's rotary kernel",
    ),
)


def register_hooks() -> None:
    """Register every hook; SGLang's ``load_plugins()`` applies them after all plugins ran."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.make(), HookType[hook.kind])

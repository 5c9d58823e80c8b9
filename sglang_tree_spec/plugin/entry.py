"""The ``sglang.srt.plugins`` entry point (see ``[project.entry-points]`` in pyproject.toml)."""

from __future__ import annotations

import logging
from typing import Any

from sglang_tree_spec.plugin.compat import UnsupportedSGLang, check_release
from sglang_tree_spec.plugin.hook import Hook
from sglang_tree_spec.plugin.hooks import HOOKS_BY_RELEASE

_registered = False


def register() -> None:
    """Register DDTREE and its hooks with SGLang; idempotent within a process.

    SGLang's ``load_plugins()`` calls this in the launcher and again in each spawned process
    (processes are spawned, so registrations never carry over), then applies the hooks.
    """
    global _registered
    if _registered:
        return
    try:
        check_release()
    except UnsupportedSGLang as error:
        _refuse_ddtree(error)
        _registered = True
        return
    from sglang_tree_spec.plugin import accounting
    from sglang_tree_spec.plugin.algorithm import register_algorithm

    register_algorithm()
    register_hooks()
    accounting.register()  # diagnostics, only with SGLANG_TREE_SPEC_ACCOUNTING set
    _registered = True


def installed_hooks() -> tuple[Hook, ...]:
    """The hook table for the installed SGLang (``compat.check_release``)."""
    return HOOKS_BY_RELEASE[check_release()]


def register_hooks() -> None:
    """Register every hook; SGLang's ``load_plugins()`` applies them after all plugins ran.

    Under Triton's interpreter the hooks it needs on Triton itself come too
    (:mod:`.interpreter`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_tree_spec.plugin.interpreter import needed_hooks

    for hook in installed_hooks() + needed_hooks():
        HookRegistry.register(hook.target, hook.make(), HookType[hook.kind])


def _refuse_ddtree(error: Exception) -> None:
    """On an SGLang the plugin cannot serve: no hooks (SGLang serves exactly as without the
    plugin), one log line, and ``--speculative-algorithm DDTREE`` fails at start-up with it."""
    logging.getLogger(__name__).error("%s", error)

    def refuse(*_: Any) -> Any:
        raise error

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from sglang_tree_spec.plugin.validation import ALGORITHM

    if get_spec(ALGORITHM) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM, supports_overlap=False, validate_server_args=refuse
        )(refuse)

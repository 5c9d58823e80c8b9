"""The ``sglang.srt.plugins`` entry point (see ``[project.entry-points]`` in pyproject.toml)."""

from __future__ import annotations

_registered = False


def register() -> None:
    """Register DDTREE and its hooks with SGLang; idempotent within a process.

    SGLang's ``load_plugins()`` calls this in the launcher and again in each spawned process
    (processes are spawned, so registrations never carry over), then applies the hooks.
    """
    global _registered
    if _registered:
        return
    from sglang_tree_spec.plugin.algorithm import register_algorithm
    from sglang_tree_spec.plugin.hooks import register_hooks

    register_algorithm()
    register_hooks()
    _registered = True

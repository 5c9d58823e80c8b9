"""SGLang adapter: the ``sglang.srt.plugins`` entry point and what it registers.

``pip install sglang-tree-spec`` next to SGLang makes :func:`register` discoverable in the
``sglang.srt.plugins`` entry-point group; SGLang runs it in every process (launcher, scheduler,
``sglang.Engine``) before it parses server arguments. It registers the ``DDTREE`` speculative
algorithm (:mod:`.algorithm`), its start-up validation (:mod:`.validation`) and the SGLang hooks
listed in :mod:`.hooks` (each mirrored by a diff in ``patches/``).

Importing this package does not import SGLang; calling :func:`register` does.
"""

from sglang_tree_spec.plugin.entry import register

__all__ = ["register"]

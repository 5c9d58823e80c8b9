"""Suite-wide collection order: the files that start the most servers first.

``launch/run-tests.sh`` runs two files at a time (pytest-xdist ``--dist loadfile``), handing the
files out in collection order; a long file handed out last would run alone at the end.
"""

from __future__ import annotations

import pytest

# The longest files (real servers), longest first; every other file keeps its place after them.
LONG_FILES = (
    "test_sglang_ddtree.py",
    "test_sglang_ddtree_overlap.py",
    "test_sglang_triton_interpreter.py",
    "test_sglang_ddtree_pages.py",
    "test_verify_graphs.py",
    "test_sglang_ddtree_params.py",
    "test_sglang_ddtree_grammar.py",
    "test_sglang_table_isolation.py",
    "test_sglang_cpu_server.py",
    "test_soak.py",
    "test_step_accounting.py",
    "test_sglang_parallel_samples.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # (stable)

#!/usr/bin/env bash
# The test suite: lint, SGLang 0.5.17's whole suite, then SGLang 0.5.23's release checks and
# real-server tests. One after the other: side by side on two cores each ran about three times
# slower (every CPU server test runs several busy processes). Extra arguments go to both runs
# (e.g. -x, -k). On 0.5.23 tests marked one_release (engine code both releases share) do not run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

RELEASE_TESTS=(
  tests/test_compat.py tests/test_plugin_registration.py tests/test_plugin_default_backend.py
  tests/test_plugin_capture_plan.py tests/test_verify_graph_wrappers.py
  tests/test_sglang_cpu_server.py
  tests/test_sglang_ddtree.py tests/test_sglang_ddtree_overlap.py tests/test_sglang_ddtree_grammar.py
  tests/test_grammar_tree.py tests/test_step_accounting.py
  tests/test_dflash_reference.py tests/test_served_drafter_fields.py
)

.venv/bin/ruff check .
.venv/bin/python -m pytest "$@"
.venv-0.5.23/bin/python -m pytest -m "not one_release" "${RELEASE_TESTS[@]}" "$@"

#!/usr/bin/env bash
# The test suite: lint, SGLang 0.5.17's whole suite, then SGLang 0.5.23's release checks and
# real-server tests. Each run takes two test files at a time (pytest-xdist, one file per worker:
# a module's servers stay in its worker), every process on one thread: a CPU server test is
# mostly one busy process at a time, so two files share two cores with little waiting, where one
# torch thread pool per core per process would oversubscribe them. Extra arguments go to both
# runs (e.g. -x, -k; -n 0 for one file at a time). On 0.5.23 tests marked one_release (engine
# code both releases share) do not run.
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
export OMP_NUM_THREADS=1
parallel=(-n "${TEST_WORKERS:-2}" --dist loadfile)
.venv/bin/python -m pytest "${parallel[@]}" "$@"
.venv-0.5.23/bin/python -m pytest "${parallel[@]}" -m "not one_release" "${RELEASE_TESTS[@]}" "$@"

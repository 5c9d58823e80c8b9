#!/usr/bin/env bash
# The test suite: lint, then SGLang 0.5.17's whole suite and SGLang 0.5.23's release checks and
# real-server tests side by side (most of a CPU server test is one Python thread waiting on its
# server, so two suites share two cores well). Each suite's output goes to its own log, printed
# when both have finished; the exit status is non-zero if either failed. Extra arguments go to
# the 0.5.17 run (e.g. -x, -k).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

RELEASE_TESTS=(
  tests/test_compat.py tests/test_plugin_registration.py tests/test_plugin_default_backend.py
  tests/test_plugin_capture_plan.py tests/test_sglang_cpu_server.py
  tests/test_sglang_ddtree.py tests/test_sglang_ddtree_overlap.py tests/test_sglang_ddtree_grammar.py
  tests/test_grammar_tree.py tests/test_step_accounting.py
  tests/test_dflash_reference.py tests/test_served_drafter_fields.py
)

.venv/bin/ruff check . || exit 1
logs=$(mktemp -d)
trap 'kill "${old:-}" "${new:-}" 2>/dev/null' INT TERM
echo "run-tests: SGLang 0.5.17 (whole suite) and 0.5.23 (${#RELEASE_TESTS[@]} files) side by side"
.venv/bin/python -m pytest "$@" > "$logs/0.5.17.log" 2>&1 &
old=$!
.venv-0.5.23/bin/python -m pytest -p no:cacheprovider "${RELEASE_TESTS[@]}" \
  > "$logs/0.5.23.log" 2>&1 &
new=$!
wait "$old"; old_status=$?
wait "$new"; new_status=$?
for release in 0.5.17 0.5.23; do
  echo "===== SGLang $release"
  cat "$logs/$release.log"
done
rm -rf "$logs"
echo "run-tests: SGLang 0.5.17 exit $old_status, SGLang 0.5.23 exit $new_status"
[ "$old_status" -eq 0 ] && [ "$new_status" -eq 0 ]

#!/usr/bin/env bash
# Set up .venv with the dev extras and run the test suite. Exit code 5 from pytest (no tests collected)
# is turned into a failure. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup_env.sh --dev || exit 1
# Three workers (K3_TEST_WORKERS), each taking whole test files (--dist loadfile: a file's module fixtures are
# built once, its tests run in order); most tests wait on child processes much of the time, so on a 2-core
# machine three workers keep both cores busier than two (the 2-worker suite used ~1.2 cores on average, 2026-12-04).
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${K3_TEST_WORKERS:-3}" --dist loadfile tests "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests (exit 5): treating as a failure" >&2
  exit 1
fi
exit $rc

#!/usr/bin/env bash
# Set up .venv with the dev extras and run the test suite. Exit code 5 from pytest (no tests collected)
# is turned into a failure. Extra arguments go to pytest.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash tools/setup_env.sh --dev || exit 1
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 tests "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
  echo "error: pytest collected no tests (exit 5): treating as a failure" >&2
  exit 1
fi
exit $rc

#!/usr/bin/env bash
# Lint, then the test suite (default: everything but `gpu`-marked tests). Extra args go to pytest.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check . || exit 1
.venv/bin/ruff format --check . || exit 1
# A temp folder of this run's own: pytest's default /tmp/pytest-of-$USER/pytest-N keeps the newest 3
# sessions' folders, so other pytest sessions started meanwhile on the machine deleted a long run's
# tmp_path folders under its running tests. Removed after a green run, kept (and named) after a red one.
base=$(mktemp -d "${TMPDIR:-/tmp}/arpo-tests.XXXXXX")
# Two workers (pytest-xdist), each test file on one worker (its module fixtures, browsers and models, are
# built once): most of the suite waits on browsers, servers and subprocesses, so two workers on this
# 2-core machine take about half the time of one. ARPO_TEST_WORKERS=0 runs it in one process.
workers=${ARPO_TEST_WORKERS:-2}
# The run's budget (tests/conftest.py): past 70 minutes each test not yet started fails at once, named, so a
# run gone slow still prints its summary inside CI's 90-minute limit (which includes setup). 0 = none.
export ARPO_TEST_DEADLINE_S=${ARPO_TEST_DEADLINE_S:-4200}
.venv/bin/python -m pytest -q -rfE --durations=30 --basetemp="$base/t" -n "$workers" --dist loadfile "$@"
rc=$?
if [ $rc -eq 0 ] || [ $rc -eq 5 ]; then rm -rf "$base"; else echo "test temp files kept in $base"; fi
# pytest exits 5 when no test was collected (e.g. a -k filter that matches nothing): not a failure of
# the code under test, but say so loudly.
if [ $rc -eq 5 ]; then echo "no tests collected"; exit 0; fi
exit $rc

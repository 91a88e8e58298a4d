#!/usr/bin/env bash
# The GPU check (benchmarks/RESULTS.md, "GPU path"): on a machine with one GPU and this
# repository alone, sets up its own venv, builds the reference MLP, then runs
# benchmarks/gpu_check.py (model alone vs served at c=1 and c=64, GPU utilisation from NVML),
# all within 10 minutes; figures to $OUT when set.
#
#   bash benchmarks/gpu_check.sh                 # one GPU
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # the same steps, tiny and on the CPU
#
# The venv (SLUICE_GPU_CHECK_VENV, default .venv-gpu; .venv for a dry run) gets
# `pip install -e ".[all,gpu]"` once, when it is made: torch is the pinned release from the
# machine's index (the CUDA build on a Linux GPU machine's PyPI). A machine without network
# whose python3 already has a CUDA torch: set SLUICE_GPU_CHECK_WHEELS to a folder holding
# wheels of the packages it lacks; they and sluice are installed without their dependencies
# (so torch is the machine's) into a folder put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
if [ -n "${SLUICE_GPU_CHECK_WHEELS:-}" ]; then
  site="${TMPDIR:-/tmp}/sluice-gpu-check-site"
  python3 -m pip install -q --no-index --no-deps --target "$site" "$SLUICE_GPU_CHECK_WHEELS"/*.whl
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$site" .
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  python=python3
else
  default=.venv-gpu
  [[ " $* " == *" --cpu-dry-run "* ]] && default=.venv
  venv="${SLUICE_GPU_CHECK_VENV:-$default}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e ".[all,gpu]"
  fi
  python="$venv/bin/python"
fi
"$python" examples/build_models.py --models mlp
# the check takes about 2 minutes on a GPU; whatever the set-up took, the script ends in 10
left=$((570 - (SECONDS - started)))
echo "set up in $((SECONDS - started)) s; the check gets at most $left s"
exec timeout --signal=INT --kill-after=20 "$left" "$python" benchmarks/gpu_check.py "$@"

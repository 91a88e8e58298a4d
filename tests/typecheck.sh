#!/usr/bin/env bash
# mypy --strict over the packages named (by default the gateway, workers, shared code and SDK).
# mypy cannot follow setuptools' package-dir mapping (sluice.shared is the folder shared/), so it
# checks a tree of links laid out as the installed package is; its messages name files in that
# layout: sluice/shared/keys.py is shared/keys.py.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/sluice"
ln -s "$root"/sluice/* "$tree/sluice/"
for folder in gateway shared workers; do ln -s "$root/$folder" "$tree/sluice/$folder"; done
packages=(sluice.gateway sluice.workers sluice.shared sluice.client)
[ $# -eq 0 ] || packages=("$@")
cd "$tree"
"$root/.venv/bin/python" -m mypy --config-file "$root/pyproject.toml" \
  --cache-dir "$root/.mypy_cache" "${packages[@]/#/--package=}"

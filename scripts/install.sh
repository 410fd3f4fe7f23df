#!/usr/bin/env bash
# Installs Sleuth and everything it needs on a fresh Debian machine; safe to run again.
#   bash scripts/install.sh          the package, torch (CPU pin first) and graphviz
#   bash scripts/install.sh --test   plus the test extras, chromium and chromium-driver
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

debs=(graphviz)
[ "$want_test" = 1 ] && debs+=(chromium chromium-driver)
missing=()
for p in "${debs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

py=${PYTHON:-python3}
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# The pin comes first: an unpinned torch would make pip fetch a multi-GB CUDA build.
"$py" -m pip install -q torch==2.13.0
extra=""; [ "$want_test" = 1 ] && extra="[test]"
# The build uses the setuptools here instead of pip's isolated build environment, which would
# fetch its own copy first.
"$py" -c "import setuptools, wheel" 2>/dev/null || "$py" -m pip install -q "setuptools>=68" wheel
"$py" -m pip install -q --no-build-isolation ".${extra}"
# The checkout's own copy of the tracer gets the statistics kernel too (tests and benchmarks
# import the packages from here): the one pip just built, else built here; optional, as in the
# package (without a C compiler the tracer uses its numpy path).
installed=$(cd / && "$py" -c "import os, tracer; print(os.path.dirname(tracer.__file__))")
found=$(ls "$installed"/storage/_stats_kernel.*.so 2>/dev/null | head -1 || true)
if [ -n "$found" ] && [ "$installed" != "$PWD/tracer" ]; then
  cp -f "$found" tracer/storage/
fi
if ! ls tracer/storage/_stats_kernel.*.so >/dev/null 2>&1; then
  "$py" setup.py -q build_ext --inplace >/dev/null 2>&1 \
    || echo "note: the tracer's statistics kernel (tracer/storage/_stats_kernel.c) did not build" \
            "here; the tracer uses its numpy path" >&2
fi

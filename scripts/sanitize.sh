#!/usr/bin/env bash
# One command for the ASan/UBSan build: builds kvroute._native with
# KVROUTE_SANITIZE=address,undefined (and KVROUTE_DEBUG, which turns on KVROUTE_DCHECK)
# into its own build dir and virtual environment, then runs pytest under the sanitizers.
#
#   scripts/sanitize.sh                       # the whole test suite
#   scripts/sanitize.sh tests/test_hashing.py # any pytest arguments
#
# Environment: SANITIZE_VENV (default build/sanitize-venv), SANITIZE_BUILD_DIR (default
# build/sanitize), SANITIZE (default address,undefined), HYPOTHESIS_PROFILE (default dev:
# instrumented code runs several times slower).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
venv="${SANITIZE_VENV:-$root/build/sanitize-venv}"
build_dir="${SANITIZE_BUILD_DIR:-build/sanitize}"
sanitize="${SANITIZE:-address,undefined}"
cxx="${CXX:-g++}"

if [ ! -x "$venv/bin/python" ]; then
  # System site packages let an offline machine reuse what is installed; pip fills any gap.
  python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
"$py" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" numpy xxhash \
  pytest hypothesis pytest-benchmark mypy >/dev/null
"$py" -m pip install --quiet --no-build-isolation -e "$root" \
  -Cbuild-dir="$build_dir" \
  -Ccmake.build-type=RelWithDebInfo \
  -Ccmake.define.KVROUTE_SANITIZE="$sanitize" \
  -Ccmake.define.CMAKE_CXX_FLAGS=-DKVROUTE_DEBUG

# Python itself is not instrumented, so the sanitizer runtimes must be loaded first.
preload=""
case ",$sanitize," in
  *,address,*) preload="$("$cxx" -print-file-name=libasan.so)" ;;
esac
case ",$sanitize," in
  *,undefined,*) preload="${preload:+$preload:}$("$cxx" -print-file-name=libubsan.so)" ;;
esac
case ",$sanitize," in
  *,thread,*) preload="${preload:+$preload:}$("$cxx" -print-file-name=libtsan.so)" ;;
esac

# CPython keeps memory alive until exit by design, so leak reports would be all noise.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_init_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}"
export PYTHONMALLOC=malloc  # let ASan see every Python allocation, not pymalloc's arenas

echo "sanitize: $sanitize (LD_PRELOAD=$preload)" >&2
LD_PRELOAD="$preload" "$py" -c "import kvroute._native"  # fail fast if the module will not load
exec env LD_PRELOAD="$preload" "$py" -m pytest -p no:cacheprovider "${@:-tests}"

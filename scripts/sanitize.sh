#!/usr/bin/env bash
# One command for a sanitizer build: builds kvroute._native with -fsanitize=$SANITIZE (and
# KVROUTE_DEBUG, which turns on KVROUTE_DCHECK) into its own build dir and virtual
# environment, installs the test extras there, then runs pytest under the sanitizers.
#
#   scripts/sanitize.sh                        # ASan+UBSan: the whole test suite
#   scripts/sanitize.sh tests/test_hashing.py  # any pytest arguments
#   SANITIZE=thread scripts/sanitize.sh        # TSan: the threaded tests (see below)
#
# Self-contained: it needs python3 (>= 3.10), a C++17 compiler with the sanitizer runtimes
# and a reachable package index; it works from a fresh clone in a fresh environment.
#
# Environment: SANITIZE (default address,undefined; "thread" for TSan, which cannot be
# combined with address), SANITIZE_VENV (default build/sanitize-venv, or
# build/sanitize-thread-venv for thread), SANITIZE_BUILD_DIR (default build/sanitize or
# build/sanitize-thread), HYPOTHESIS_PROFILE (default dev: instrumented code runs several
# times slower), CXX (default g++, to find the runtimes).
#
# TSan mode without arguments runs every test whose name says "thread" or "concurrent"
# (name a new threaded test so, and it is covered) plus the subscriber's ZMQ tests, whose
# background thread applies events while the test thread reads. scripts/tsan.supp holds
# the suppressions; each says why.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
sanitize="${SANITIZE:-address,undefined}"
case ",$sanitize," in
  *,thread,*) suffix="-thread" ;;
  *) suffix="" ;;
esac
venv="${SANITIZE_VENV:-$root/build/sanitize$suffix-venv}"
build_dir="${SANITIZE_BUILD_DIR:-build/sanitize$suffix}"
cxx="${CXX:-g++}"

if [ ! -x "$venv/bin/python" ]; then
  # System site packages let an offline machine reuse what is installed; pip fills any gap.
  python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
# -O1 -g1 (line tables) halves the instrumented compile of the pybind11 bindings against
# -O2 -g (31 s vs 61 s of CPU for register_router.cpp under ASan+UBSan), which is most of a
# CI sanitizer step, and still reports every frame with file and line.
# The build backend first (the editable install below runs without build isolation, so the
# sanitizer flags reach CMake), then kvroute with its test extras: everything pytest imports.
"$py" -m pip install --quiet "scikit-build-core>=0.10" "pybind11>=2.12" >/dev/null
"$py" -m pip install --quiet --no-build-isolation -e "$root[test]" \
  -Cbuild-dir="$build_dir" \
  -Ccmake.build-type=RelWithDebInfo \
  "-Ccmake.define.CMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1" \
  -Ccmake.define.KVROUTE_SANITIZE="$sanitize" \
  -Ccmake.define.CMAKE_CXX_FLAGS=-DKVROUTE_DEBUG

# Python itself is not instrumented, so the sanitizer runtimes must be loaded first.
preload=""
add_runtime() { preload="${preload:+$preload:}$("$cxx" -print-file-name="$1")"; }
case ",$sanitize," in *,address,*) add_runtime libasan.so ;; esac
case ",$sanitize," in *,undefined,*) add_runtime libubsan.so ;; esac
case ",$sanitize," in *,thread,*) add_runtime libtsan.so ;; esac

# CPython keeps memory alive until exit by design, so leak reports would be all noise.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:strict_init_order=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:print_stacktrace=1}"
export TSAN_OPTIONS="${TSAN_OPTIONS:-halt_on_error=1:abort_on_error=1:second_deadlock_stack=1:suppressions=$root/scripts/tsan.supp}"
export HYPOTHESIS_PROFILE="${HYPOTHESIS_PROFILE:-dev}"
case ",$sanitize," in
  # TSan tracks every access; pymalloc's arenas are fine for it and much faster.
  *,thread,*) ;;
  *) export PYTHONMALLOC=malloc ;;  # let ASan see every Python allocation, not pymalloc's arenas
esac

args=("$@")
if [ ${#args[@]} -eq 0 ]; then
  case ",$sanitize," in
    *,thread,*) args=(tests -k "thread or concurrent or test_events_zmq") ;;
    *) args=(tests) ;;
  esac
fi

echo "sanitize: $sanitize (LD_PRELOAD=$preload)" >&2
LD_PRELOAD="$preload" "$py" -c "import kvroute._native"  # fail fast if the module will not load
exec env LD_PRELOAD="$preload" "$py" -m pytest -p no:cacheprovider "${args[@]}"

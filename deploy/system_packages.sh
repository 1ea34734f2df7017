#!/bin/sh
# The Debian packages the project uses outside its venv: whichever of NAMES are missing are installed in one
# apt-get run (as root, where apt-get exists); otherwise a warning says what each one missing costs and how to
# install it. Never fails: the venv and the suite go on, and the tests that need a missing package say so.
#
#   deploy/system_packages.sh NAME...       NAME: blas | browser | haproxy
#
#   blas     libopenblas0-pthread: MLX's CPU matmuls are ~48x faster than with the wheel's reference BLAS
#   browser  chromium + libatomic1 (Playwright's node driver needs it; slim images lack it): the dashboard's
#            browser tests (tests/integration/browser.py launches /usr/bin/chromium, or $MLX_LANE_CHROMIUM)
#   haproxy  Debian's HAProxy 2.6 (consistent hashing, JSON body fetches): `make cluster` and its tests
#
# One apt-get for all (`make test` asks for the three at once): each `apt-get update` costs 10-20 s on a fresh
# machine.
set -u

missing=""
want() { missing="$missing $1"; }
is_linux() { [ "$(uname -s)" = "Linux" ]; }

for name in "$@"; do
  case "$name" in
    blas)
      is_linux || continue
      ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 >/dev/null 2>&1 || want libopenblas0-pthread ;;
    browser)
      { command -v chromium >/dev/null 2>&1 || [ -n "${MLX_LANE_CHROMIUM:-}" ]; } || want chromium
      { ! is_linux || ldconfig -p 2>/dev/null | grep -q libatomic.so.1; } || want libatomic1 ;;
    haproxy)
      { command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; } || want haproxy ;;
    *)
      echo "deploy/system_packages.sh: unknown name '$name' (blas, browser, haproxy)" >&2
      exit 2 ;;
  esac
done

[ -n "$missing" ] || exit 0

if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "installing$missing (apt-get)"
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
      $missing) >/dev/null; then
    exit 0
  fi
  echo "WARNING: apt-get could not install$missing"
fi

for package in $missing; do
  case "$package" in
    libopenblas0-pthread) echo "WARNING: OpenBLAS runtime not found: MLX on the CPU will be ~48x slower at matmuls." ;;
    chromium) echo "WARNING: Chromium not found: the dashboard's browser tests will fail (or set MLX_LANE_CHROMIUM=/path/to/chromium)." ;;
    libatomic1) echo "WARNING: libatomic1 not found: Playwright's driver cannot start, the dashboard's browser tests will fail." ;;
    haproxy) echo "WARNING: haproxy not found: the cluster tests are skipped and make cluster cannot run." ;;
  esac
done
echo "         Install them with: sudo apt-get install$missing"
exit 0

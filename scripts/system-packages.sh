#!/usr/bin/env bash
# The Debian packages that `make test` and `make demo` need, installed when missing (the Makefile
# runs this first, so a fresh machine needs nothing but `make`). Installs with apt-get, through
# sudo when not root, non-interactively; installs nothing when all are present.
#
#   chromium      test: /usr/bin/chromium, which the web UI's browser tests (tests/web) drive
#                 through Playwright; not with KVGRAFT_SKIP_BROWSER=1, which skips those tests
#   curl          test: the browser tests run the UI's auditor commands, which fetch with curl
#   golang-go, golang-golang-x-mod-dev
#                 test: tests/registry/test_tiles.py builds tests/registry/tlogtiles (Go's sumdb/tlog
#                 and sumdb/note, from /usr/share/gocode, no module download) to read the registry's
#                 tlog-tiles independently
#   postgresql    test: tests/registry/test_postgres.py, and the registry, crash and load suites on
#                 their PostgreSQL backend, start a real server (initdb, pg_ctl and postgres from
#                 /usr/lib/postgresql/<version>/bin) on a data directory of their own and a free
#                 loopback port, as the package's postgres user when run as root (tests/registry/postgres.py)
#   cmake, ninja-build, build-essential
#                 test and demo: scripts/setup_llama_cpp.sh builds llama.cpp (the llamacpp-cpu
#                 profile's engine and llama-server) from llama-cpp-python's pinned sdist
#   python3-venv  test and demo: `python3 -m venv` (the Makefile's .venv, and the verifier-only
#                 venv that tests/verifier/test_standalone_install.py builds) needs ensurepip
#
# The demo's other tools (bash, dd, cmp, sha256sum, cut, grep, xargs) are in Debian's essential
# packages. Usage: scripts/system-packages.sh test|demo [PYTHON]   (PYTHON: the venv's interpreter)
set -euo pipefail

FOR="${1:?usage: scripts/system-packages.sh test|demo [PYTHON]}"
PYTHON="${2:-python3}"
case "$FOR" in test | demo) ;; *) echo "system-packages: test or demo, not ${FOR@Q}" >&2; exit 2 ;; esac
missing=()
if [ "$FOR" = test ]; then
  if [ "${KVGRAFT_SKIP_BROWSER:-}" != "1" ] && [ ! -x /usr/bin/chromium ]; then missing+=(chromium); fi
  command -v curl >/dev/null 2>&1 || missing+=(curl)
  command -v go >/dev/null 2>&1 || missing+=(golang-go)
  [ -d /usr/share/gocode/src/golang.org/x/mod/sumdb/tlog ] || missing+=(golang-golang-x-mod-dev)
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
fi
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
{ command -v cc && command -v c++ && command -v make; } >/dev/null 2>&1 || missing+=(build-essential)
# Only Debian's own interpreter is mended by python3-venv; another one (pyenv, a missing one) is left be.
py="$(command -v "$PYTHON" 2>/dev/null || true)"
if [ -n "$py" ] && ! "$py" -c "import ensurepip, venv" >/dev/null 2>&1; then
  case "$(readlink -f "$py")" in /usr/bin/*) missing+=(python3-venv) ;; esac
fi

[ "${#missing[@]}" -eq 0 ] && exit 0

echo "system-packages: installing ${missing[*]} (Debian packages)" >&2
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-packages: no apt-get here; install ${missing[*]} with this system's package manager" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "system-packages: not root and no sudo; as root run: apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  SUDO=sudo
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"

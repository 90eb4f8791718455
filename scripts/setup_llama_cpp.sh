#!/usr/bin/env bash
# Install llama-cpp-python into the project's venv, built from PyPI's sdist (pinned by sha256)
# on this machine: the engine of the `llamacpp-cpu` profile (engine/_internal/llamacpp.py), the
# llama-server that `kvgraft slot` is tested against, and the peer the benchmarks compare with.
# `make install` (and so `make test` and `make demo`) runs it.
#
#     bash scripts/setup_llama_cpp.sh [PYTHON]      # PYTHON defaults to .venv/bin/python
#
# Why not `pip install llama-cpp-python`: its build compiles every tool and example of llama.cpp
# beside the library; on 2 cores that took over 40 minutes. Here only the `llama` shared library,
# its ggml libraries and llama.cpp's own `llama-server` (with the `common` and `mtmd` libraries
# it links, no web UI) are built (Release, -march=native, Ninja), the Python package is installed
# without compiling anything (LLAMA_BUILD=OFF), and the libraries and the server are copied where
# the package loads its libraries from (llama_cpp/lib; the server finds them beside itself). The
# build is cached per version and CPU flags under ${KVGRAFT_BENCH_CACHE:-~/.cache/kvgraft/bench},
# so a second clone on the same machine reuses it.
#
# ggml's AMX backend is compiled out (-mno-amx-*; every other -march=native flag stays): on this
# project's Intel machines with AMX its first matrix product crashes the process (SIGSEGV in
# ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824, open upstream), which killed `make bench`.
# llama.cpp then multiplies with its AVX-512 (VNNI, BF16) kernels, as on any CPU without AMX.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VERSION=0.3.36
# The sdist's sha256 (PyPI's file, checked before anything in it is built).
SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DISKCACHE=diskcache==5.6.3
# What the libraries were built with; an install or cache entry of another build is replaced.
BUILD="native-no-amx+server"
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"

# Where the package loads its libraries from, found without importing it (it loads them at import
# time, and before the first install there are none); empty when the package is not installed.
package_lib() {
    "$PY" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(s.origin).parent / "lib" if s else "")'
}

lib="$(package_lib)"
if [ -n "$lib" ] && [ "$(cat "$lib/kvgraft-build" 2>/dev/null)" = "$BUILD" ] &&
    "$PY" -c "import sys, llama_cpp; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "llama-cpp-python $VERSION ($BUILD) is already installed"
    exit 0
fi
for tool in cmake ninja cc c++; do
    command -v "$tool" >/dev/null || {
        echo "error: $tool is needed to build llama.cpp" >&2
        echo "hint: install it (Debian: apt-get install -y cmake ninja-build build-essential), then rerun" >&2
        exit 1
    }
done

cpu_key="$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)"
cache="${KVGRAFT_BENCH_CACHE:-$HOME/.cache/kvgraft/bench}/llama-cpp-python-$VERSION-$BUILD-$cpu_key"
sdist="$cache/llama_cpp_python-$VERSION.tar.gz"

if [ ! -f "$cache/done" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    started=$SECONDS
    echo "building llama.cpp's libllama from llama-cpp-python $VERSION's sdist (a few minutes on 2 cores)"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work"
    got="$(sha256sum "$work/llama_cpp_python-$VERSION.tar.gz" | cut -d' ' -f1)"
    if [ "$got" != "$SDIST_SHA256" ]; then
        echo "error: llama_cpp_python-$VERSION.tar.gz has sha256 $got, pinned $SDIST_SHA256" >&2
        echo "hint: the package index served other bytes under this version; do not build them" >&2
        exit 1
    fi
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
    cmake -S "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$work/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
        -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$work/configure.log"
    # The server's web UI is neither built nor fetched (no network): llama-server serves the API.
    cmake --build "$work/build" --target llama llama-server --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >"$work/build.log"
    # Assembled beside the cache entry, then renamed: an interrupted build leaves no entry.
    rm -rf "$cache.partial"
    mkdir -p "$cache.partial/lib"
    cp -a "$work"/build/bin/*.so* "$work/build/bin/llama-server" "$cache.partial/lib/"
    echo "$BUILD" > "$cache.partial/lib/kvgraft-build"
    # llama.cpp's version and commit (the profile's fingerprint names them), as the server reports them.
    "$work/build/bin/llama-server" --version 2>&1 | grep -m1 '^version:' | sed 's/^version: //' > "$cache.partial/lib/kvgraft-llama-version"
    cp "$work/llama_cpp_python-$VERSION.tar.gz" "$cache.partial/"
    # The libraries must load from wherever they are copied (the build folder is about to go).
    "$PY" -c "import ctypes, sys; ctypes.CDLL(sys.argv[1])" "$cache.partial/lib/libllama.so"
    touch "$cache.partial/done"
    rm -rf "$cache"
    mv "$cache.partial" "$cache"
    echo "built in $((SECONDS - started)) s; cached in $cache"
fi

# The Python bindings only: LLAMA_BUILD=OFF makes the sdist's build compile nothing.
CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" "$PY" -m pip install --quiet --no-deps "$sdist" "$DISKCACHE"
lib="$(package_lib)"
mkdir -p "$lib"
# The libraries and the build's tag.
cp -a "$cache"/lib/. "$lib/"
"$PY" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready:', llama_cpp.llama_print_system_info().decode()[:80])"

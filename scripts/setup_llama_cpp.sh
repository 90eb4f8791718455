#!/usr/bin/env bash
# Install llama-cpp-python (the peer the TTFT benchmark compares against) into the project's
# venv, built from PyPI's sdist on this machine.
#
#     bash bench/setup_llama_cpp.sh [PYTHON]        # PYTHON defaults to .venv/bin/python
#
# Why not `pip install llama-cpp-python`: its build also compiles llama.cpp's `common` library
# and the multimodal `mtmd` library (forced on by its CMakeLists), which the benchmark never
# loads; on 2 cores that took over 40 minutes. Here only the `llama` shared library and its ggml
# libraries are built (Release, -march=native, Ninja), the Python package is installed without
# compiling anything (LLAMA_BUILD=OFF), and the libraries are copied where the package loads
# them from (llama_cpp/lib). The built libraries are cached per version and CPU flags under
# ${KVGRAFT_BENCH_CACHE:-~/.cache/kvgraft/bench}, so a second clone on the same machine reuses
# them. Nothing here is part of `make test`.
#
# ggml's AMX backend is compiled out (-mno-amx-*; every other -march=native flag stays): on this
# project's Intel machines with AMX its first matrix product crashes the process (SIGSEGV in
# ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824, open upstream), which killed `make bench`.
# llama.cpp then multiplies with its AVX-512 (VNNI, BF16) kernels, as on any CPU without AMX.
set -euo pipefail

PY="${1:-.venv/bin/python}"
VERSION=0.3.36
DISKCACHE=diskcache==5.6.3
# What the libraries were built with; an install or cache entry of another build is replaced.
BUILD="native-no-amx"
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
    tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
    cmake -S "$work/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$work/build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN' \
        -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$work/configure.log"
    cmake --build "$work/build" --target llama --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" >"$work/build.log"
    # Assembled beside the cache entry, then renamed: an interrupted build leaves no entry.
    rm -rf "$cache.partial"
    mkdir -p "$cache.partial/lib"
    cp -a "$work"/build/bin/*.so* "$cache.partial/lib/"
    echo "$BUILD" > "$cache.partial/lib/kvgraft-build"
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

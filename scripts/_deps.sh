# Sourced by the scripts: installs the Debian packages the build needs (plus
# any named as arguments), but only those missing (apt-get update once, when needed).
csfmoe_install_deps() {
  local pkgs=(cmake g++ make libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libfmt-dev zlib1g-dev "$@")
  local missing=()
  local p
  for p in "${pkgs[@]}"; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  echo "installing: ${missing[*]}" >&2
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# cuobjdump and the nvdisasm it runs (PyPI wheels) into BUILD/cuda-tools, where
# tests/CMakeLists.txt finds it for the SASS check; nothing when nvcc is absent
# or the toolkit has its own.
csfmoe_install_cuobjdump() {
  local build=$1
  command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]] || return 0
  [[ -x /usr/local/cuda/bin/cuobjdump || -x $build/cuda-tools/nvidia/cu13/bin/cuobjdump ]] && return 0
  mkdir -p "$build"
  python3 -m pip install -q --disable-pip-version-check --target "$build/cuda-tools" "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14" ||
    echo "csfmoe: could not install cuobjdump; the SASS check will be skipped" >&2
}

# Configures and builds build/ (Release); CUDA kernels compile when nvcc is found.
csfmoe_build() {
  local root=$1
  shift
  local build=${CSFMOE_BUILD_DIR:-$root/build}
  local cmake_args=(-S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release)
  if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  cmake "${cmake_args[@]}"
  cmake --build "$build" -j "$(nproc)" "$@"
}

# csfmoe_build with its output in $build/build.log and one summary line on
# stderr (the log's last lines on failure): for scripts a new user runs first.
csfmoe_build_quiet() {
  local root=$1
  local build=${CSFMOE_BUILD_DIR:-$root/build}
  local log=$build/build.log t0=$SECONDS
  mkdir -p "$build"
  echo "csfmoe: building in $build (Release; log: $log) ..." >&2
  if ! csfmoe_build "$@" >"$log" 2>&1; then
    echo "csfmoe: build failed; the end of $log:" >&2
    tail -n 40 "$log" >&2
    return 1
  fi
  local cuda="without CUDA kernels (no nvcc)"
  grep -q "CUDA kernels ON" "$log" 2>/dev/null && cuda="with CUDA kernels"
  echo "csfmoe: built in $((SECONDS - t0)) s, $cuda" >&2
}

# Device machine (no package registry): when a header the build needs is
# missing, unpacks the .deb files carried in $1/.devdeps (scripts/stage-device)
# into /tmp/csfmoe-deps and points CMake and the loader at them. Says what it
# did on stdout; returns 1 if a .deb could not be unpacked.
csfmoe_device_deps() {
  local root=$1 missing=0 h
  for h in gtest/gtest.h fmt/core.h nlohmann/json.hpp CLI/CLI.hpp zlib.h benchmark/benchmark.h; do
    [[ -f /usr/include/$h ]] || missing=1
  done
  ((missing == 0)) && return 0
  if ! compgen -G "$root/.devdeps/*.deb" >/dev/null; then
    echo "dependencies missing and no .devdeps/*.deb carried: the build will likely fail"
    return 0
  fi
  local prefix=/tmp/csfmoe-deps deb z lib status=0
  mkdir -p "$prefix"
  for deb in "$root"/.devdeps/*.deb; do
    dpkg-deb -x "$deb" "$prefix" || {
      echo "cannot unpack $deb"
      status=1
    }
  done
  lib=$prefix/usr/lib/x86_64-linux-gnu
  # zlib1g-dev's libz.so is an absolute link to the packaging system's libz.
  if [[ ! -e $lib/libz.so ]]; then
    z=$(ls "$prefix"/lib/x86_64-linux-gnu/libz.so.1.* "$prefix"/usr/lib/x86_64-linux-gnu/libz.so.1.* 2>/dev/null | head -1)
    [[ -n $z ]] && ln -sf "$z" "$lib/libz.so"
  fi
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=$lib:$prefix/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "dependencies: using carried .debs unpacked in $prefix"
  return $status
}

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

# Device machine (no package registry): when the build's -dev packages are
# missing, unpacks the .deb files carried in $1/.devdeps (scripts/stage-device)
# into /tmp/csfmoe-deps and points CMake and the loader at them.
csfmoe_device_deps() {
  local root=$1
  [[ -f /usr/include/fmt/core.h ]] && return 0
  local prefix=/tmp/csfmoe-deps deb z
  mkdir -p $prefix
  for deb in "$root"/.devdeps/*.deb; do dpkg-deb -x "$deb" $prefix; done
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  # zlib1g-dev's libz.so is an absolute link to the packaging system's libz.
  z=$(ls $prefix/lib/x86_64-linux-gnu/libz.so.1.* $prefix/usr/lib/x86_64-linux-gnu/libz.so.1.* 2>/dev/null | head -1)
  [[ -e $lib/libz.so ]] || ln -sf "$z" $lib/libz.so
  export CMAKE_PREFIX_PATH=$prefix/usr LD_LIBRARY_PATH=$lib:$prefix/lib/x86_64-linux-gnu
}

#!/usr/bin/env bash
# Fetches a CUDA 13 toolkit from NVIDIA's wheels on the Python package index into one folder,
# without a system CUDA: `fetch-toolkit.sh DEST` (`cargo xtask plugins --backend cuda
# --fetch-toolkit` runs it into target/toolkits/cuda). DEST gets a toolkit layout (bin/nvcc,
# nvvm/, include/, lib/ and lib64/) that CMake takes as CUDAToolkit_ROOT, with nvcc first on
# PATH.
#
# The cu13 wheels (all under site-packages/nvidia/cu13) make a complete nvcc toolchain; they
# lack the unversioned .so links a build links with, made here. They have no libcuda.so (the
# driver): the plugin is built with -DGGML_CUDA_NO_VMM=ON (plugins/cuda/plugin.toml), which
# needs none. The versions are pinned below (13.0, the nvcc of the machines we test on);
# DEST/VERSIONS lists them (xtask keys its plugin cache with that file).
set -euo pipefail

dest=${1:?usage: fetch-toolkit.sh DEST}
wheels=(
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14
)
python=$(command -v python3 || true)
[ -n "$python" ] && "$python" -m pip --version >/dev/null 2>&1 || {
    echo "fetch-toolkit.sh: needs python3 with pip (to download the CUDA wheels)" >&2
    exit 2
}
[ "$(uname -sm)" = "Linux x86_64" ] || { echo "fetch-toolkit.sh: fetches the x86_64 Linux wheels; this is $(uname -sm)" >&2; exit 2; }
command -v unzip >/dev/null || { echo "fetch-toolkit.sh: needs unzip (apt-get install unzip)" >&2; exit 2; }

mkdir -p "$(dirname "$dest")"
dest=$(cd "$(dirname "$dest")" && pwd)/$(basename "$dest")
work="$dest.partial"
rm -rf "$work"
mkdir -p "$work/.wheels"
echo "fetch-toolkit.sh: downloading ${wheels[*]} (about 500 MB)"
"$python" -m pip download -q --no-deps --only-binary=:all: --dest "$work/.wheels" "${wheels[@]}" || {
    echo "fetch-toolkit.sh: could not download ${wheels[*]}" >&2
    exit 1
}
for w in "$work/.wheels"/*.whl; do
    unzip -qo "$w" 'nvidia/cu13/*' -d "$work/.unpacked"
done
mv "$work/.unpacked/nvidia/cu13"/* "$work/"
rm -rf "$work/.unpacked" "$work/.wheels"
# the links a link step looks for
for lib in cudart cublas cublasLt; do
    so=$(cd "$work/lib" && ls "lib$lib.so."* | head -1)
    ln -sf "$so" "$work/lib/lib$lib.so"
done
ln -s lib "$work/lib64"
"$work/bin/nvcc" --version >/dev/null || { echo "fetch-toolkit.sh: the fetched nvcc does not run here" >&2; exit 1; }
printf '%s\n' "${wheels[@]}" > "$work/VERSIONS"

rm -rf "$dest"
mv "$work" "$dest"
echo "fetch-toolkit.sh: the CUDA toolkit is in $dest:"
sed 's/^/  /' "$dest/VERSIONS"

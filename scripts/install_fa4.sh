#!/usr/bin/env bash
# FlashAttention-4 (the fa4 extra: model.attention_backend auto | fa4) for a CUDA 13 GPU machine without network, as
# pinned wheels in .whl/fa4/ (Python 3.12 unless given). With network, pip install -e ".[fa4]".
#   scripts/install_fa4.sh download [PYTHON_VERSION]   # where pip reaches the registry: the wheels into .whl/fa4/
#   scripts/install_fa4.sh DIR                         # on the GPU machine, from .whl/fa4/ only, into DIR
# Installed into a folder (pip --target), the CuTe DSL's .pth file is not read: put DIR and
# DIR/nvidia_cutlass_dsl/dsl_packages on PYTHONPATH, as the last line printed says. einops and typing_extensions,
# which flash-attn-4 also imports, are in the CUDA images with torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  flash-attn-4==4.0.0b36 quack-kernels==0.6.5 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5
  nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 nvidia-cutlass-dsl-libs-core==4.8.1
  nvidia-cutlass-dsl-libs-cu13==4.8.1   # 88 MiB: the CUDA 13 libraries of the CuTe DSL
)

if [ "${1:-}" = download ]; then
  platforms=()
  for tag in manylinux_2_28_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
    platforms+=(--platform "$tag")
  done
  exec "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${2:-3.12}" --implementation cp \
    "${platforms[@]}" -d .whl/fa4 "${WHEELS[@]}"
fi
target=${1:?give the folder to install into, or download}
"$PYTHON" -m pip install -q --no-deps --no-index --no-compile --find-links .whl/fa4 --target "$target" \
  "${WHEELS[@]:0:7}"
# The libraries' wheel unpacked over the nvidia_cutlass_dsl folder its siblings created: pip would replace that folder
# whole (--upgrade) or refuse to touch it.
"$PYTHON" -m zipfile -e .whl/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-*.whl "$target"
echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"

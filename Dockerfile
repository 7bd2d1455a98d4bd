# corp-deploy with a complete TensorRT toolchain, for machines with an NVIDIA GPU.
#
# Base: NVIDIA's TensorRT container, pinned by tag (TensorRT 10.8 with its Python bindings and
# trtexec, CUDA 12.8, Python 3.12, Ubuntu 24.04). The container's own `tensorrt` satisfies the
# `[trt]` extra, so pip keeps it; torch, timm, ONNX Runtime (GPU build) and Polygraphy come from
# PyPI as pyproject.toml says.
#
#   docker build -t corp-deploy .
#   docker run --gpus all --rm -v "$PWD:/work" corp-deploy export corp-deploy/deit_base-s0.5 --trt --dense
#
# Not built or run on this project's test machines (they have no Docker engine and no GPU).
FROM nvcr.io/nvidia/tensorrt:25.01-py3

ENV PIP_BREAK_SYSTEM_PACKAGES=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1

WORKDIR /opt/corp-deploy
COPY pyproject.toml README.md ./
COPY corp_deploy ./corp_deploy
COPY exporters ./exporters
COPY benchmarks ./benchmarks
RUN python3 -m pip install ".[trt]" \
 && python3 -c "import tensorrt, corp_deploy, exporters; print('TensorRT', tensorrt.__version__)"

# build_engine.sh looks for trtexec on PATH: link the container's copy there, or fail the build.
RUN command -v trtexec >/dev/null || { \
      bin="$(find / -xdev -type f -name trtexec -perm -u+x 2>/dev/null | head -n 1)"; \
      test -n "$bin" && ln -s "$bin" /usr/local/bin/trtexec; }

WORKDIR /work
ENTRYPOINT ["corp-deploy"]
CMD ["--help"]

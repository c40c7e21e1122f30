#!/usr/bin/env bash
# On the CUDA machine: builds bench/gpu/cupti_trace.c into /tmp/cupti_trace.so (bench/gpu/cupti.py's Tracer;
# Nsight Systems is not there). A queue line of its own before a traced bench (decode_scale.py --trace).
set -eu
# libcupti's file has an odd version suffix there (libcupti.so.2025.3.1): link by directory
cupti_dir=$(dirname "$(find /usr/local /opt -name "libcupti.so*" 2>/dev/null | head -1)")
cupti_inc=$(dirname "$(find /usr/local /opt -name cupti.h 2>/dev/null | head -1)")
nvcc -shared -Xcompiler -fPIC -I"$cupti_inc" -L"$cupti_dir" -o /tmp/cupti_trace.so bench/gpu/cupti_trace.c -lcupti \
  -Xlinker -rpath="$cupti_dir"
echo "/tmp/cupti_trace.so built against $cupti_dir"

#!/usr/bin/env bash
# nvcc for `cargo check` / `cargo clippy` builds of candle-core with CUDA (scripts/check-candle-cuda.sh).
#
# candle-kernels' build script compiles candle's own CUDA kernels (PTX it embeds with
# include_str!, and a static library of its quantized-matmul kernels): about 8 minutes of nvcc
# on 2 cores, for outputs that a check build never links, loads or reads. This wrapper answers
# those compilations with empty but well-formed outputs — a PTX file holding only its header, an
# empty object, an empty `ar` archive — and passes every other call to the real nvcc
# ($RINGATTN_REAL_NVCC): ringattn's own kernels (build.rs) are compiled for real.
#
# Only for check builds: a program linked against these outputs would fail to load candle's
# kernels (the stage never links one: linking needs libcuda, which a machine without a driver
# lacks). Candle's kernels are candle's to test.
set -euo pipefail
real=${RINGATTN_REAL_NVCC:?set RINGATTN_REAL_NVCC to the real nvcc}

candle=0
for arg in "$@"; do
  case "$arg" in
    */candle-kernels-*) candle=1 ;;
  esac
done
if [ "$candle" -eq 0 ]; then
  exec "$real" "$@"
fi

mode="" output="" outdir="" source=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ptx | -ptx) mode=ptx ;;
    -c) mode=obj ;;
    --lib | -lib) mode=lib ;;
    -o) output=$2; shift ;;
    --output-directory | -odir) outdir=$2; shift ;;
    *.cu) source=$1 ;;
  esac
  shift
done

case "$mode" in
  ptx)
    [ -n "$source" ] && [ -n "$outdir" ] || { echo "nvcc-check-only: --ptx without a source or --output-directory" >&2; exit 2; }
    printf '//\n// empty PTX for a check build (scripts/nvcc-check-only.sh)\n//\n.version 8.0\n.target sm_80\n.address_size 64\n' \
      >"$outdir/$(basename "$source" .cu).ptx"
    ;;
  obj)
    [ -n "$output" ] || { echo "nvcc-check-only: -c without -o" >&2; exit 2; }
    : >"$output"
    ;;
  lib)
    [ -n "$output" ] || { echo "nvcc-check-only: --lib without -o" >&2; exit 2; }
    printf '!<arch>\n' >"$output"
    ;;
  *)
    echo "nvcc-check-only: unexpected call for candle-kernels: $*" >&2
    exit 2
    ;;
esac

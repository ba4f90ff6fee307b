#!/usr/bin/env bash
# Side-by-side CPU comparison with PyTorch SDPA (f32 or bf16, forward and backward, alternating runs).
# Creates a venv with torch from PyPI on first use (about 3 GB; set TORCH_VENV to reuse one).
# Usage: scripts/compare-torch.sh [--shape b,s,hq,hkv,d] [--causal] [--dtype f32|bf16] [--rounds N] [--json FILE]
#        scripts/compare-torch.sh --matrix DIR [--shape b,s,hq,hkv,d] [--rounds N]
#        (f32 and bf16, full and causal, one JSON each in DIR, and the README's table)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${TORCH_VENV:-target/venv-torch}
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch numpy
fi
cargo build --release --example throughput
exec "$venv/bin/python" scripts/compare_torch.py "$@"

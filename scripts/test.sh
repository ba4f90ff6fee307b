#!/usr/bin/env bash
# The whole test suite, from a fresh clone on a machine with only the Rust toolchain, gcc and
# Python: formatting, lints, unit/integration/property/CLI tests and doc tests. Prints the
# time of each stage. Usage: scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

stage_start=$(date +%s)
total_start=$stage_start
stage() {
  local now
  now=$(date +%s)
  printf '\n=== [%4ss] %s\n' "$((now - total_start))" "$*"
  stage_start=$now
}
done_stage() {
  printf '=== %s took %ss\n' "$1" "$(($(date +%s) - stage_start))"
}

stage "toolchain"
cargo --version
rustc --version
command -v cargo-clippy >/dev/null 2>&1 || rustup component add clippy rustfmt >/dev/null 2>&1 || true
done_stage toolchain

stage "cargo fmt --check"
cargo fmt --all -- --check
done_stage fmt

stage "cargo clippy --all-targets -D warnings"
cargo clippy --all-targets -- -D warnings
done_stage clippy

stage "cargo test (unit, integration, property, CLI and doc tests)"
cargo test --all-targets
cargo test --doc
done_stage test

printf '\n=== all stages passed in %ss\n' "$(($(date +%s) - total_start))"

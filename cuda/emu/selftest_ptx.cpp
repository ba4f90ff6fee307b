// Test kernels for the PTX twins of ptx.cuh added in issue 4 (m16n8k8, ldmatrix x1,
// stmatrix, bf16/f16 conversions). Driven by src/emu/ptx_tests.rs.
#include "emu/emu.h"
#include "ptx.cuh"

//! Tests of the PTX twins added for issue 4 (m16n8k8, ldmatrix x1, stmatrix, conversions)
//! against the lane tables of the PTX ISA.

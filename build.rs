//! Build script. Today it only declares the cfgs the crate uses and watches `cuda/`;
//! the kernel toolchain (nvcc discovery, cubin/PTX embedding, the host emulator) arrives
//! with the CUDA kernel work and will live here.
fn main() {
    println!("cargo::rustc-check-cfg=cfg(has_nvcc)");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=RINGATTN_CUDA_ARCHS");
}

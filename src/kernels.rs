//! The CUDA kernel images that `build.rs` compiled from `cuda/*.cu` and embedded: a cubin per
//! kernel family and architecture of `RINGATTN_CUDA_ARCHS`, plus PTX for newer GPUs. Empty
//! when the crate was built without nvcc. The CUDA backend loads these; nothing runs them
//! yet in this release.
//!
//! ```
//! for image in ringattn::kernels::images() {
//!     assert!(!image.bytes.is_empty());
//! }
//! ```

/// What an image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// An ELF cubin for one architecture (`sm_80`, `sm_90a`, ...).
    Cubin,
    /// PTX text, JIT-compiled by the driver for GPUs newer than the cubins.
    Ptx,
}

/// One compiled kernel family for one target.
#[derive(Debug, Clone, Copy)]
pub struct KernelImage {
    /// Kernel family: the `cuda/*.cu` file it came from (`merge`, ...).
    pub family: &'static str,
    /// `sm_XX` for cubins, `compute_XX` for PTX.
    pub target: &'static str,
    /// Cubin or PTX.
    pub kind: ImageKind,
    /// The image.
    pub bytes: &'static [u8],
}

#[cfg(has_nvcc)]
include!(concat!(env!("OUT_DIR"), "/kernel_images.rs"));

/// Without nvcc at build time there are no images.
#[cfg(not(has_nvcc))]
pub static IMAGES: &[KernelImage] = &[];

/// Every embedded image.
pub fn images() -> &'static [KernelImage] {
    IMAGES
}

/// Whether this build embedded kernels (nvcc was found at build time).
pub fn compiled() -> bool {
    !IMAGES.is_empty()
}

/// Mirrors of the `#[repr(C)]` parameter structs of `cuda/params.h`.
pub mod params {
    /// `MergeParams` of `cuda/params.h` (merge kernel): pointers to `o_acc`, `lse_acc`,
    /// `o_part`, `lse_part` (device addresses) and the dims `b, s, h, d`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
    pub struct MergeParams {
        /// `[b, s, h, d]` f32, read and written.
        pub o_acc: u64,
        /// `[b, h, s]` f32, read and written.
        pub lse_acc: u64,
        /// `[b, s, h, d]` f32.
        pub o_part: u64,
        /// `[b, h, s]` f32.
        pub lse_part: u64,
        /// Batch.
        pub b: i64,
        /// Rows.
        pub s: i64,
        /// Heads.
        pub h: i64,
        /// Head dimension.
        pub d: i64,
    }

    // The same size and alignment as the C struct (static_asserts in cuda/params.h).
    const _: () = assert!(std::mem::size_of::<MergeParams>() == 64);
    const _: () = assert!(std::mem::align_of::<MergeParams>() == 8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_match_the_build() {
        if cfg!(has_nvcc) {
            let merge: Vec<_> = images().iter().filter(|i| i.family == "merge").collect();
            assert!(merge.iter().any(|i| i.kind == ImageKind::Ptx), "PTX for newer GPUs");
            for i in &merge {
                match i.kind {
                    ImageKind::Cubin => assert_eq!(&i.bytes[..4], b"\x7fELF", "{} cubin", i.target),
                    ImageKind::Ptx => {
                        let text = std::str::from_utf8(i.bytes).unwrap();
                        assert!(text.contains(".target") && text.contains("ringattn_merge_f32"));
                    }
                }
            }
            assert!(merge.iter().filter(|i| i.kind == ImageKind::Cubin).count() >= 1);
        } else {
            assert!(images().is_empty() && !compiled());
        }
    }
}

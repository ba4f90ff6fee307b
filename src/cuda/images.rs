//! Which embedded kernel image a GPU loads (pure: no driver call, unit-tested without a GPU).
//!
//! CUDA's compatibility rules: a cubin built for `sm_XY` runs on GPUs of compute capability
//! `X.Z` with `Z >= Y` (same major); an arch-specific cubin (`sm_90a`) runs only on exactly
//! `9.0`; PTX for `compute_XY` is JIT-compiled by the driver for any GPU of capability
//! `>= X.Y`, provided the driver understands the PTX ISA version (CUDA 13.0's nvcc writes ISA
//! 9.0, which needs a CUDA 13.0 driver, R580 or newer).

use crate::kernels::{ImageKind, KernelImage};
use crate::{Error, Result};

/// `sm_90a` → `(9, 0, true)`, `sm_80` / `compute_80` → `(8, 0, false)`; `None` for anything
/// else. The last digit is the minor version, the digits before it the major.
pub(crate) fn parse_target(target: &str) -> Option<(i32, i32, bool)> {
    let digits = target.strip_prefix("sm_").or_else(|| target.strip_prefix("compute_"))?;
    let (digits, arch_specific) = match digits.strip_suffix('a') {
        Some(d) => (d, true),
        None => (digits.strip_suffix('f').unwrap_or(digits), false),
    };
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (major, minor) = digits.split_at(digits.len() - 1);
    Some((major.parse().ok()?, minor.parse().ok()?, arch_specific))
}

/// The images of `family` that a GPU of compute capability `cc` can load, best first: the
/// exact cubin (`sm_90a` or `sm_90` for 9.0), then compatible cubins of the same major
/// (highest minor first), then PTX of a capability not above `cc` (highest first, JIT).
pub(crate) fn candidates<'a>(images: &'a [KernelImage], family: &str, cc: (i32, i32)) -> Vec<&'a KernelImage> {
    let mut exact = Vec::new();
    let mut compatible = Vec::new();
    let mut ptx = Vec::new();
    for image in images.iter().filter(|i| i.family == family) {
        let Some((major, minor, arch_specific)) = parse_target(image.target) else { continue };
        match image.kind {
            ImageKind::Cubin if (major, minor) == cc => exact.push((arch_specific, image)),
            ImageKind::Cubin if !arch_specific && major == cc.0 && minor < cc.1 => compatible.push((minor, image)),
            ImageKind::Cubin => {}
            ImageKind::Ptx if !arch_specific && (major, minor) <= cc => ptx.push(((major, minor), image)),
            ImageKind::Ptx => ptx.extend(((major, minor) == cc).then_some(((major, minor), image))),
        }
    }
    // Arch-specific first: it may use instructions (wgmma, setmaxnreg) the portable one lacks.
    exact.sort_by_key(|&(a, _)| !a);
    compatible.sort_by_key(|&(m, _)| -m);
    ptx.sort_by_key(|&((ma, mi), _)| (-ma, -mi));
    exact
        .into_iter()
        .map(|x| x.1)
        .chain(compatible.into_iter().map(|x| x.1))
        .chain(ptx.into_iter().map(|x| x.1))
        .collect()
}

/// What the build embedded for `family`, for error messages: `sm_80 cubin, sm_90a cubin,
/// compute_90 PTX`, or `nothing`.
pub(crate) fn embedded(images: &[KernelImage], family: &str) -> String {
    let list: Vec<String> = images
        .iter()
        .filter(|i| i.family == family)
        .map(|i| format!("{} {}", i.target, if i.kind == ImageKind::Cubin { "cubin" } else { "PTX" }))
        .collect();
    if list.is_empty() {
        "nothing".into()
    } else {
        list.join(", ")
    }
}

/// Which embedded image a GPU of compute capability `cc` loads, described for people:
/// `sm_90a cubin`, or `compute_120 PTX (JIT-compiled by the driver at first load)`; every
/// kernel family must have one.
///
/// # Errors
/// [`Error::Cuda`] naming the capability, the family without an image, and what the build
/// embedded (`RINGATTN_CUDA_ARCHS` rebuilds for it).
///
/// ```
/// if ringattn::kernels::compiled() {
///     assert_eq!(ringattn::cuda::image_for((9, 0))?, "sm_90a cubin"); // H100/H200
/// }
/// # Ok::<(), ringattn::Error>(())
/// ```
pub fn image_for(cc: (i32, i32)) -> Result<String> {
    describe_choice(crate::kernels::images(), cc)
}

pub(crate) fn describe_choice(images: &[KernelImage], cc: (i32, i32)) -> Result<String> {
    let mut families: Vec<&str> = images.iter().map(|i| i.family).collect();
    families.sort_unstable();
    families.dedup();
    if families.is_empty() {
        return Err(Error::Cuda("this build embedded no CUDA kernels (nvcc was not found at build time)".into()));
    }
    let mut described = None;
    for family in &families {
        let Some(best) = candidates(images, family, cc).into_iter().next() else {
            return Err(Error::Cuda(format!(
                "no embedded image of `{family}` runs on compute capability {}.{} (this build has {}); rebuild with \
                 RINGATTN_CUDA_ARCHS including sm_{}{}",
                cc.0,
                cc.1,
                embedded(images, family),
                cc.0,
                cc.1
            )));
        };
        described.get_or_insert(match best.kind {
            ImageKind::Cubin => format!("{} cubin", best.target),
            ImageKind::Ptx => format!("{} PTX (JIT-compiled by the driver at first load)", best.target),
        });
    }
    Ok(described.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn img(target: &'static str, kind: ImageKind) -> KernelImage {
        KernelImage { family: "flash_fwd", target, kind, size: 1, deflated: b"x" }
    }

    fn pick(images: &[KernelImage], cc: (i32, i32)) -> Vec<&'static str> {
        candidates(images, "flash_fwd", cc).iter().map(|i| i.target).collect()
    }

    #[test]
    fn targets_parse() {
        assert_eq!(parse_target("sm_90a"), Some((9, 0, true)));
        assert_eq!(parse_target("sm_80"), Some((8, 0, false)));
        assert_eq!(parse_target("compute_90"), Some((9, 0, false)));
        assert_eq!(parse_target("sm_100a"), Some((10, 0, true)));
        assert_eq!(parse_target("sm_120"), Some((12, 0, false)));
        assert_eq!(parse_target("sm_x"), None);
        assert_eq!(parse_target("gfx90a"), None);
    }

    /// The default build (`sm_80,sm_90a,sm_100,sm_120` + `compute_120` PTX): every current
    /// GPU loads a cubin, none needs the JIT.
    #[test]
    fn the_default_build_has_a_cubin_for_every_current_gpu() {
        let families = ["flash_fwd", "flash_bwd", "merge", "ops"];
        let mut build = Vec::new();
        for family in families {
            for t in ["sm_80", "sm_90a", "sm_100", "sm_120"] {
                build.push(KernelImage { family, target: t, kind: ImageKind::Cubin, size: 1, deflated: b"x" });
            }
            build.push(KernelImage { family, target: "compute_120", kind: ImageKind::Ptx, size: 1, deflated: b"x" });
        }
        let cases = [
            ((8, 0), "sm_80 cubin"),   // A100
            ((8, 6), "sm_80 cubin"),   // RTX 30xx, A40: binary compatible
            ((8, 9), "sm_80 cubin"),   // RTX 40xx, L4, L40
            ((9, 0), "sm_90a cubin"),  // H100, H200
            ((10, 0), "sm_100 cubin"), // B200
            ((10, 3), "sm_100 cubin"), // B300: same major
            ((12, 0), "sm_120 cubin"), // RTX 50xx
            ((12, 1), "sm_120 cubin"), // DGX Spark
        ];
        for (cc, want) in cases {
            assert_eq!(describe_choice(&build, cc).unwrap(), want, "{cc:?}");
        }
        // A GPU after the newest cubin JIT-compiles the PTX; an older one has nothing.
        assert!(describe_choice(&build, (13, 0)).unwrap().starts_with("compute_120 PTX (JIT"));
        let e = describe_choice(&build, (7, 5)).unwrap_err().to_string();
        assert!(e.contains("7.5") && e.contains("sm_75"), "{e}");
        assert!(describe_choice(&[], (9, 0)).unwrap_err().to_string().contains("no CUDA kernels"));
        // What this build embedded answers the same way (when nvcc was found and the default
        // architectures were kept).
        if crate::kernels::targets() == ["sm_80", "sm_90a", "sm_100", "sm_120", "compute_120"] {
            for (cc, want) in cases {
                assert_eq!(image_for(cc).unwrap(), want, "{cc:?}");
            }
        }
    }

    #[test]
    fn selection_follows_the_compatibility_rules() {
        let build =
            [img("sm_80", ImageKind::Cubin), img("sm_90a", ImageKind::Cubin), img("compute_90", ImageKind::Ptx)];
        // H100/H200: the arch-specific cubin, then the PTX (sm_80 cubins do not run on 9.0).
        assert_eq!(pick(&build, (9, 0)), ["sm_90a", "compute_90"]);
        // A100: its cubin only (compute_90 PTX is above 8.0).
        assert_eq!(pick(&build, (8, 0)), ["sm_80"]);
        // RTX 30xx/40xx (8.6, 8.9): the sm_80 cubin is binary compatible.
        assert_eq!(pick(&build, (8, 9)), ["sm_80"]);
        // Blackwell (10.0, 12.0): PTX JIT only; sm_90a never runs elsewhere.
        assert_eq!(pick(&build, (10, 0)), ["compute_90"]);
        assert_eq!(pick(&build, (12, 0)), ["compute_90"]);
        // Volta: nothing.
        assert!(pick(&build, (7, 0)).is_empty());
        // Portable sm_90 cubin after the arch-specific one; other families ignored.
        let more = [img("sm_90", ImageKind::Cubin), img("sm_90a", ImageKind::Cubin), img("compute_80", ImageKind::Ptx)];
        assert_eq!(pick(&more, (9, 0)), ["sm_90a", "sm_90", "compute_80"]);
        assert!(candidates(&more, "merge", (9, 0)).is_empty());
        assert_eq!(embedded(&build, "flash_fwd"), "sm_80 cubin, sm_90a cubin, compute_90 PTX");
        assert_eq!(embedded(&build, "merge"), "nothing");
    }
}

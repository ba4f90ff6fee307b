//! What `cuModuleLoadData` receives, read as the driver reads it: an ELF cubin (its
//! architecture from `e_flags`, its kernels from the symbol table, each kernel's parameters,
//! launch bounds, registers and static shared memory from `.nv.info`), PTX text (`.version`,
//! `.target`, the `.entry` names and their `.param` lists) or a fatbin of either (the entry
//! the device would pick). No length is passed with the image: each kind is sized from its own
//! header (ELF section table, fatbin header, PTX's terminating NUL).

use std::collections::HashMap;

use crate::codes::{Failure, INVALID_IMAGE, INVALID_PTX, NOT_SUPPORTED, NO_BINARY_FOR_GPU, UNSUPPORTED_PTX_VERSION};

/// A kernel's parameter in the parameter space (constant bank 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub ordinal: u32,
    /// Offset within the parameter space (the image's, padded for absolute alignment).
    pub offset: u32,
    pub size: u32,
}

/// One kernel entry point of an image.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct KernelInfo {
    pub name: String,
    /// Parameters by ordinal.
    pub params: Vec<Param>,
    /// Where the parameter space starts in constant bank 0 (0x210 on sm_90).
    pub param_base: u32,
    /// `__launch_bounds__` threads, if any.
    pub max_threads: Option<u32>,
    /// Registers per thread (0 when the image does not say).
    pub registers: u32,
    /// Static shared memory per block, bytes.
    pub static_smem: u32,
}

/// A loaded image: its target and kernels.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Image {
    /// `sm_90`, `compute_90`, ...
    pub target: String,
    pub kernels: HashMap<String, KernelInfo>,
}

/// Parameter space base in constant bank 0 by architecture (cuda-driver.md §2.8).
fn param_base_for(sm: u32) -> u32 {
    match sm {
        0..=89 => 0x160,
        90..=99 => 0x210,
        _ => 0x380,
    }
}

/// Reads the image at `ptr` for a device of compute capability `cc` (major·10 + minor).
///
/// # Safety
/// `ptr` must point at a whole image (as `cuModuleLoadData` requires).
pub unsafe fn load(ptr: *const u8, cc: u32) -> Result<Image, Failure> {
    if ptr.is_null() {
        return Err(Failure::new(INVALID_IMAGE, "cuModuleLoadData: null image"));
    }
    // SAFETY: an image is at least 16 bytes (every kind's header).
    let head = unsafe { std::slice::from_raw_parts(ptr, 16) };
    if head[..4] == *b"\x7fELF" {
        let len = unsafe { elf_len(ptr) }?;
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        return parse_cubin(bytes, cc);
    }
    if u32::from_le_bytes([head[0], head[1], head[2], head[3]]) == 0xBA55_ED50 {
        let size = u64::from_le_bytes(head[8..16].try_into().unwrap_or_default()) as usize;
        let bytes = unsafe { std::slice::from_raw_parts(ptr, 16 + size) };
        return parse_fatbin(bytes, cc);
    }
    // PTX: text up to the NUL.
    let text = unsafe { std::ffi::CStr::from_ptr(ptr.cast()) };
    let text =
        text.to_str().map_err(|_| Failure::new(INVALID_IMAGE, "the image is neither ELF, fatbin nor PTX text"))?;
    if !text.contains(".target") {
        return Err(Failure::new(INVALID_IMAGE, "the image is neither ELF, fatbin nor PTX text (no .target)"));
    }
    parse_ptx(text, cc)
}

fn u16_at(b: &[u8], o: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], o: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], o: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?))
}

/// The extent of the ELF at `ptr`: the end of its furthest section or table.
unsafe fn elf_len(ptr: *const u8) -> Result<usize, Failure> {
    let bad = || Failure::new(INVALID_IMAGE, "truncated ELF header");
    // SAFETY: an ELF64 header is 64 bytes.
    let h = unsafe { std::slice::from_raw_parts(ptr, 64) };
    if h[4] != 2 {
        return Err(Failure::new(INVALID_IMAGE, "not a 64-bit ELF"));
    }
    let shoff = u64_at(h, 0x28).ok_or_else(bad)? as usize;
    let shentsize = u16_at(h, 0x3a).ok_or_else(bad)? as usize;
    let shnum = u16_at(h, 0x3c).ok_or_else(bad)? as usize;
    let phoff = u64_at(h, 0x20).ok_or_else(bad)? as usize;
    let phentsize = u16_at(h, 0x36).ok_or_else(bad)? as usize;
    let phnum = u16_at(h, 0x38).ok_or_else(bad)? as usize;
    if shentsize != 64 || shnum == 0 || shoff > 1 << 32 {
        return Err(Failure::new(INVALID_IMAGE, "ELF without a valid section table"));
    }
    let mut end = (shoff + shnum * shentsize).max(phoff + phnum * phentsize).max(64);
    // SAFETY: the section table lies within the image.
    let table = unsafe { std::slice::from_raw_parts(ptr.add(shoff), shnum * shentsize) };
    for i in 0..shnum {
        let s = &table[i * 64..(i + 1) * 64];
        let ty = u32_at(s, 4).unwrap_or(0);
        let (off, size) = (u64_at(s, 0x18).unwrap_or(0) as usize, u64_at(s, 0x20).unwrap_or(0) as usize);
        if ty != 8 {
            // NOBITS sections occupy no bytes of the file.
            end = end.max(off + size);
        }
    }
    Ok(end)
}

struct Section<'a> {
    name: String,
    info: u32,
    data: &'a [u8],
    size: u64,
}

fn sections(b: &[u8]) -> Option<Vec<Section<'_>>> {
    let shoff = u64_at(b, 0x28)? as usize;
    let shnum = u16_at(b, 0x3c)? as usize;
    let shstrndx = u16_at(b, 0x3e)? as usize;
    let raw: Vec<(u32, u32, u32, usize, usize)> = (0..shnum)
        .map(|i| {
            let s = shoff + i * 64;
            Some((
                u32_at(b, s)?,
                u32_at(b, s + 4)?,
                u32_at(b, s + 0x2c)?,
                u64_at(b, s + 0x18)? as usize,
                u64_at(b, s + 0x20)? as usize,
            ))
        })
        .collect::<Option<_>>()?;
    let (_, _, _, str_off, str_size) = *raw.get(shstrndx)?;
    let strtab = b.get(str_off..str_off + str_size)?;
    let name_at = |o: usize| -> String {
        strtab
            .get(o..)
            .map(|s| s.split(|&c| c == 0).next().unwrap_or(&[]))
            .map_or(String::new(), |s| String::from_utf8_lossy(s).into_owned())
    };
    raw.iter()
        .map(|&(name, ty, info, off, size)| {
            let data = if ty == 8 { &[][..] } else { b.get(off..off + size)? };
            Some(Section { name: name_at(name as usize), info, data, size: size as u64 })
        })
        .collect()
}

/// `.nv.info` records: (format, attribute, payload).
fn nv_info(data: &[u8]) -> Vec<(u8, u8, &[u8], u16)> {
    let mut out = Vec::new();
    let mut o = 0;
    while o + 4 <= data.len() {
        let (fmt, attr) = (data[o], data[o + 1]);
        let v = u16::from_le_bytes([data[o + 2], data[o + 3]]);
        o += 4;
        if fmt == 4 {
            let end = (o + v as usize).min(data.len());
            out.push((fmt, attr, &data[o..end], v));
            o = end;
        } else {
            out.push((fmt, attr, &[][..], v));
        }
    }
    out
}

/// Whether a cubin for `sm` runs on a device of capability `cc` (same major, minor at most
/// the device's; cuda-driver.md §4.5).
fn cubin_runs(sm: u32, cc: u32) -> bool {
    sm / 10 == cc / 10 && sm % 10 <= cc % 10
}

/// A cubin's kernels, for a device of capability `cc`.
pub fn parse_cubin(b: &[u8], cc: u32) -> Result<Image, Failure> {
    let bad = |what: &str| Failure::new(INVALID_IMAGE, format!("cubin: {what}"));
    if u16_at(b, 0x12) != Some(190) {
        return Err(bad("e_machine is not EM_CUDA (190)"));
    }
    let abi = b[8];
    let flags = u32_at(b, 0x30).ok_or_else(|| bad("truncated header"))?;
    let sm = if abi >= 8 { (flags >> 8) & 0xff } else { flags & 0xff };
    if !cubin_runs(sm, cc) {
        return Err(Failure::new(
            NO_BINARY_FOR_GPU,
            format!("a cubin for sm_{sm} does not run on the emulated compute capability {}.{}", cc / 10, cc % 10),
        ));
    }
    let secs = sections(b).ok_or_else(|| bad("unreadable section table"))?;
    // Kernels: `.text.<name>` sections whose symbol is a global function (st_other 0x10 marks
    // entries; the section name is enough here, and `.nv.info.<name>` holds its attributes).
    let mut kernels = HashMap::new();
    let mut regs_by_section: HashMap<String, u32> = HashMap::new();
    for s in &secs {
        if let Some(name) = s.name.strip_prefix(".text.") {
            // sh_info's top byte holds the register count of a kernel's text section.
            regs_by_section.insert(name.to_string(), s.info >> 24);
        }
    }
    for s in &secs {
        let Some(name) = s.name.strip_prefix(".nv.info.") else { continue };
        let mut k = KernelInfo { name: name.to_string(), param_base: param_base_for(sm), ..Default::default() };
        for (fmt, attr, payload, _) in nv_info(s.data) {
            match (fmt, attr) {
                (4, 0x17) if payload.len() >= 12 => {
                    let ordinal = u32::from(u16_at(payload, 4).unwrap_or(0));
                    let offset = u32::from(u16_at(payload, 6).unwrap_or(0));
                    let f = u32_at(payload, 8).unwrap_or(0);
                    k.params.push(Param { ordinal, offset, size: (f >> 18) & 0x3fff });
                }
                (4, 0x0a) if payload.len() >= 8 => k.param_base = u32_at(payload, 4).unwrap_or(0) & 0xffff,
                (4, 0x05) if payload.len() >= 12 => {
                    let t = u32_at(payload, 0).unwrap_or(0)
                        * u32_at(payload, 4).unwrap_or(1)
                        * u32_at(payload, 8).unwrap_or(1);
                    k.max_threads = (t > 0).then_some(t);
                }
                _ => {}
            }
        }
        k.params.sort_by_key(|p| p.ordinal);
        k.registers = regs_by_section.get(name).copied().unwrap_or(0);
        if let Some(sh) = secs.iter().find(|x| x.name == format!(".nv.shared.{name}")) {
            // sm_90 and later count a 1 KiB reserve in the section (cuda-driver.md §4.2).
            let reserve = if sm >= 90 { 1024 } else { 0 };
            k.static_smem = (sh.size as u32).saturating_sub(reserve);
        }
        kernels.insert(k.name.clone(), k);
    }
    if kernels.is_empty() {
        return Err(bad("no kernels (.nv.info.<name> sections)"));
    }
    Ok(Image { target: format!("sm_{sm}"), kernels })
}

/// PTX: `.version` at most 9.0 (CUDA 13.0's), `.target sm_XX[a]` at most the device's
/// capability (exactly it with `a`), the `.entry` kernels with their `.param` sizes and
/// alignments, laid out as ptxas lays out the parameter space (absolutely aligned).
pub fn parse_ptx(text: &str, cc: u32) -> Result<Image, Failure> {
    let word_after = |key: &str| {
        text.lines()
            .map(str::trim)
            .find_map(|l| l.strip_prefix(key))
            .map(|r| r.split_whitespace().next().unwrap_or("").trim_end_matches(',').to_string())
    };
    let version = word_after(".version ").ok_or_else(|| Failure::new(INVALID_PTX, "PTX without .version"))?;
    let (maj, min) = version
        .split_once('.')
        .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
        .ok_or_else(|| Failure::new(INVALID_PTX, format!("PTX .version {version}")))?;
    if (maj, min) > (9, 0) {
        return Err(Failure::new(
            UNSUPPORTED_PTX_VERSION,
            format!("PTX ISA {maj}.{min} is newer than this driver's (CUDA 13.0: 9.0)"),
        ));
    }
    let target = word_after(".target ").ok_or_else(|| Failure::new(INVALID_PTX, "PTX without .target"))?;
    let num: u32 = target
        .trim_start_matches("sm_")
        .trim_end_matches(['a', 'f'])
        .parse()
        .map_err(|_| Failure::new(INVALID_PTX, format!("PTX .target {target}")))?;
    if num > cc || (target.ends_with('a') && num != cc) {
        return Err(Failure::new(
            NO_BINARY_FOR_GPU,
            format!("PTX for {target} cannot be compiled for the emulated compute capability {}.{}", cc / 10, cc % 10),
        ));
    }
    let base = param_base_for(cc);
    let mut kernels = HashMap::new();
    let mut rest = text;
    while let Some(i) = rest.find(".entry ") {
        rest = &rest[i + 7..];
        let name: String =
            rest.trim_start().chars().take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '$').collect();
        let body = rest.split(')').next().unwrap_or("");
        let mut k = KernelInfo { name: name.clone(), param_base: base, ..Default::default() };
        let mut off = 0u32;
        for (ordinal, decl) in body.split(".param").skip(1).enumerate() {
            let words: Vec<&str> = decl.split_whitespace().collect();
            let align = words.windows(2).find(|w| w[0] == ".align").and_then(|w| w[1].parse::<u32>().ok());
            let ty = words
                .iter()
                .find(|w| w.starts_with(".b") || w.starts_with(".u") || w.starts_with(".s") || w.starts_with(".f"))
                .copied()
                .unwrap_or(".b8");
            let elem: u32 = ty[2..].parse::<u32>().unwrap_or(8) / 8;
            let count: u32 = decl
                .split('[')
                .nth(1)
                .and_then(|r| r.split(']').next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(1);
            let align = align.unwrap_or(elem).max(1);
            // Absolutely aligned in the constant bank (cuda-driver.md §2.8).
            while !(base + off).is_multiple_of(align) {
                off += 1;
            }
            k.params.push(Param { ordinal: ordinal as u32, offset: off, size: elem * count });
            off += elem * count;
        }
        if let Some(t) = rest.split('{').next().and_then(|h| h.split(".maxntid").nth(1)) {
            let n: u32 = t
                .split(['\n', '.'])
                .next()
                .unwrap_or("")
                .split(',')
                .filter_map(|x| x.trim().parse::<u32>().ok())
                .product();
            k.max_threads = (n > 0).then_some(n);
        }
        kernels.insert(name, k);
    }
    if kernels.is_empty() {
        return Err(Failure::new(INVALID_PTX, "PTX without .entry kernels"));
    }
    Ok(Image { target: format!("compute_{num}"), kernels })
}

/// A fatbin: the uncompressed ELF entry that runs on `cc`, else the best PTX entry.
pub fn parse_fatbin(b: &[u8], cc: u32) -> Result<Image, Failure> {
    let mut o = 16;
    let mut cubin: Option<&[u8]> = None;
    let mut ptx: Option<(u32, &[u8])> = None;
    let mut seen = Vec::new();
    while o + 64 <= b.len() {
        let kind = u16_at(b, o).unwrap_or(0);
        let header = u32_at(b, o + 4).unwrap_or(0) as usize;
        let payload = u32_at(b, o + 8).unwrap_or(0) as usize;
        let compressed = u32_at(b, o + 16).unwrap_or(0);
        let sm = u32_at(b, o + 28).unwrap_or(0);
        let flags = u64_at(b, o + 40).unwrap_or(0);
        if header < 64 {
            break;
        }
        let data = b.get(o + header..o + header + payload).unwrap_or(&[]);
        seen.push(format!("{} sm_{sm}", if kind == 2 { "ELF" } else { "PTX" }));
        if compressed != 0 || flags & (0x2000 | 0x8000) != 0 {
            return Err(Failure::new(NOT_SUPPORTED, format!("fatbin entry sm_{sm} is compressed (LZ4/Zstd): the emulated driver reads uncompressed entries only")));
        }
        if kind == 2 && cubin_runs(sm, cc) {
            cubin = Some(data);
        } else if kind == 1 && sm <= cc && ptx.is_none_or(|(s, _)| sm > s) {
            ptx = Some((sm, data));
        }
        o += header + payload;
    }
    if let Some(c) = cubin {
        return parse_cubin(c, cc);
    }
    if let Some((_, p)) = ptx {
        let text = String::from_utf8_lossy(p.split(|&c| c == 0).next().unwrap_or(&[])).into_owned();
        return parse_ptx(&text, cc);
    }
    Err(Failure::new(
        NO_BINARY_FOR_GPU,
        format!("no fatbin entry runs on compute capability {}.{} (entries: {})", cc / 10, cc % 10, seen.join(", ")),
    ))
}

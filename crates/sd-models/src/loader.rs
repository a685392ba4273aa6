//! Model files as a weight source: bytes from the memory map, converted to the type a model asks for.
//!
//! Checks done here, each an error naming the tensor and its file: missing
//! tensor, element count that disagrees with the architecture, NaN or infinite
//! values in float weights, an impossible type conversion, and a file that changed
//! size or modification time since it was opened (`ModelFiles::check_unchanged`).
//!
//! Once a tensor's bytes have been copied to its device, [`FileSource::release`] drops the
//! map's pages holding them from the process (Linux `madvise(MADV_DONTNEED)`): they stay in
//! the page cache, but no longer count in our resident set, so loading a model does not
//! leave a second, mapped copy of every weight resident next to the device copy.

use std::borrow::Cow;

use sd_backends::convert;
use sd_backends::GgmlType;
use sd_sched::{MappedBytes, SourceError, TensorSource};

use crate::files::{DType, ModelFiles, TensorEntry};

/// A [`TensorSource`] reading from opened model files.
pub struct FileSource<'a> {
    files: &'a ModelFiles,
}

impl std::fmt::Debug for FileSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FileSource({:?})", self.files)
    }
}

impl<'a> FileSource<'a> {
    /// A source over `files`.
    pub fn new(files: &'a ModelFiles) -> Self {
        Self { files }
    }

    fn path_of(&self, e: &TensorEntry) -> String {
        self.files.index().files().get(e.file).map(|f| f.path.display().to_string()).unwrap_or_default()
    }
}

/// The ggml type a tensor stored as `d` is loaded as: its own, or f16 for the 8-bit floats
/// ([`DType::loaded`]).
pub fn ggml_type(d: DType) -> Option<GgmlType> {
    d.loaded().ggml_type_id().map(GgmlType)
}

/// The file's storage type of every tensor, for models choosing their own storage types.
pub fn dtype_of(files: &ModelFiles) -> impl Fn(&str) -> Option<GgmlType> + '_ {
    move |name| files.index().get(name).and_then(|e| ggml_type(e.dtype))
}

/// The AutoencoderKL layout of the opened files' VAE tensors (`first_stage_model.*`: latent
/// channels, quant convs), to check a `--vae` against the family's configuration with
/// [`sd_vae::VaeConfig::check_layout`].
pub fn vae_layout(files: &ModelFiles) -> sd_vae::Result<sd_vae::VaeLayout> {
    sd_vae::VaeLayout::of_tensors(|name| files.index().get(name).map(TensorEntry::ne))
}

/// Index of the first non-finite value in float data, if any.
fn first_non_finite(ty: GgmlType, data: &[u8]) -> Option<usize> {
    match ty {
        GgmlType::GGML_TYPE_F32 => first_where::<4>(data, |c| u32::from_le_bytes(c) & 0x7f80_0000 == 0x7f80_0000),
        // f16: exponent bits all ones means inf or NaN.
        GgmlType::GGML_TYPE_F16 => first_where::<2>(data, |c| u16::from_le_bytes(c) & 0x7c00 == 0x7c00),
        GgmlType::GGML_TYPE_BF16 => first_where::<2>(data, |c| u16::from_le_bytes(c) & 0x7f80 == 0x7f80),
        _ => None,
    }
}

/// Whether every value of f16 `data` (at least one) is +-65504, f16's largest: a weight
/// saturated by an overflowing conversion. It is finite, so the NaN scan passes it, but no
/// trained weight looks like that and every output computed from it overflows to inf/NaN
/// (the reference runs it and writes a black image). The loop stops at the first other
/// value, so a real weight costs one comparison.
fn saturated_f16(data: &[u8]) -> bool {
    !data.is_empty() && data.chunks_exact(2).all(|c| u16::from_le_bytes([c[0], c[1]]) & 0x7fff == 0x7bff)
}

/// How a quantized block stores one of its scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ScaleCode {
    /// An IEEE half (`ggml_half`): exponent bits all ones is an infinity or a NaN.
    F16,
    /// iq1_m's half, spread over the top 4 bits of the four u16 of its `scales` (low
    /// nibble first, as `dequantize_row_iq1_m` reassembles it).
    Iq1m,
}

/// The scales of one block of `ty`: (field name in ggml-common.h, byte offset in the block,
/// encoding). Every quantized type a weight may have, from the `block_*` structs of
/// ggml-common.h (llama-cpp-sys-2 0.1.161); `None` for plain types and for the two whose
/// scales are never non-finite: nvfp4's UE4M3 scales have no infinity or NaN (ggml reads
/// 0x7F as 0), and mxfp4's E8M0 `e` is at most 2^126 as `dequantize_row_mxfp4` reads it
/// (`ggml_e8m0_to_fp32_half`; times its largest value, 12, that overflows f32, as an f16
/// weight of 65504 may overflow an activation: a finite scale).
fn block_scales(ty: GgmlType) -> Option<&'static [(&'static str, usize, ScaleCode)]> {
    use ScaleCode::{Iq1m, F16};
    const D0: &[(&str, usize, ScaleCode)] = &[("d", 0, F16)];
    const DM: &[(&str, usize, ScaleCode)] = &[("d", 0, F16), ("m", 2, F16)];
    const DMIN: &[(&str, usize, ScaleCode)] = &[("d", 0, F16), ("dmin", 2, F16)];
    Some(match DType::from_ggml_type_id(ty.0)? {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::Q1_0 | DType::Q2_0 => D0,
        DType::IQ2_XXS | DType::IQ2_XS | DType::IQ2_S | DType::IQ3_XXS | DType::IQ3_S => D0,
        DType::IQ1_S | DType::IQ4_NL | DType::IQ4_XS => D0,
        DType::Q4_1 | DType::Q5_1 => DM,
        DType::Q4_K | DType::Q5_K => DMIN,
        DType::Q2_K => &[("d", 80, F16), ("dmin", 82, F16)],
        DType::Q3_K => &[("d", 108, F16)],
        DType::Q6_K => &[("d", 208, F16)],
        DType::TQ1_0 => &[("d", 52, F16)],
        DType::TQ2_0 => &[("d", 64, F16)],
        DType::IQ1_M => &[("scales", 48, Iq1m)],
        _ => return None,
    })
}

/// The first block of quantized `data` of type `ty` with a non-finite scale: (block index,
/// elements per block, the scale's field name).
fn first_bad_scale(ty: GgmlType, data: &[u8]) -> Option<(usize, u64, &'static str)> {
    let fields = block_scales(ty)?;
    let d = DType::from_ggml_type_id(ty.0)?;
    let bad = |block: &[u8], &(_, at, code): &(&str, usize, ScaleCode)| match code {
        ScaleCode::F16 => u16::from_le_bytes([block[at], block[at + 1]]) & 0x7c00 == 0x7c00,
        ScaleCode::Iq1m => {
            let sc = |i: usize| u16::from_le_bytes([block[at + 2 * i], block[at + 2 * i + 1]]);
            let h = (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000);
            h & 0x7c00 == 0x7c00
        }
    };
    data.chunks_exact(d.block_bytes() as usize)
        .enumerate()
        .find_map(|(i, block)| fields.iter().find(|f| bad(block, f)).map(|&(name, _, _)| (i, d.block_size(), name)))
}

/// Index of the first `N`-byte element of `data` for which `bad` holds. Blocks are
/// tested whole, without an early exit (the compiler vectorises that loop: a scalar search
/// was a third of a small run's time, every weight of every model passing through it), and
/// only a block that holds a bad element is searched.
fn first_where<const N: usize>(data: &[u8], bad: impl Fn([u8; N]) -> bool) -> Option<usize> {
    const BLOCK: usize = 4096;
    let elem = |c: &[u8]| -> [u8; N] { c.try_into().expect("chunks_exact yields N bytes") };
    data.chunks(BLOCK * N).enumerate().find_map(|(b, block)| {
        let any = block.chunks_exact(N).fold(false, |acc, c| acc | bad(elem(c)));
        any.then(|| b * BLOCK + block.chunks_exact(N).position(|c| bad(elem(c))).expect("the block holds one"))
    })
}

impl TensorSource for FileSource<'_> {
    fn load(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'_, [u8]>, SourceError> {
        self.load_tensor(name, ty, ne)
    }

    fn release(&self, name: &str) {
        if let Some(e) = self.files.index().get(name) {
            release_pages(self.files, e);
        }
    }

    fn mapped(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        self.mapped_tensor(name, ty, ne)
    }
}

impl<'a> FileSource<'a> {
    /// [`TensorSource::load`] with the bytes borrowed from the files rather than the source.
    pub fn load_tensor(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'a, [u8]>, SourceError> {
        self.load_checked(name, ty, ne).map_err(SourceError::new)
    }

    /// [`TensorSource::mapped`]: the checked bytes of `name` in the memory map when they are
    /// stored as `ty` (no conversion).
    ///
    /// Their life: the maps live as long as the `ModelFiles`, read-only; a truncation while
    /// they are in use ends the run with a message naming the file (the SIGBUS guard), and
    /// [`ModelFiles::check_unchanged`] ran before. A source handing these out must own (a
    /// share of) the `ModelFiles`, as `pipeline`'s does.
    pub fn mapped_tensor(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Option<MappedBytes>, SourceError> {
        match self.load_checked(name, ty, ne).map_err(SourceError::new)? {
            // SAFETY: see above; the maps start at page boundaries.
            Cow::Borrowed(bytes) => Ok(Some(unsafe { MappedBytes::new(bytes) })),
            Cow::Owned(_) => Ok(None),
        }
    }

    fn load_checked(&self, name: &str, ty: GgmlType, ne: &[i64]) -> Result<Cow<'a, [u8]>, LoadError> {
        let files: &'a ModelFiles = self.files;
        let e = self.files.index().get(name).ok_or_else(|| LoadError::Missing { tensor: name.to_string() })?;
        let tensor = || (e.original_name.clone(), self.path_of(e));
        let want: i64 = ne.iter().product();
        if e.n_elements() as i64 != want {
            let (tensor, path) = tensor();
            return Err(LoadError::Shape {
                tensor,
                path,
                shape: e.shape.clone(),
                elements: e.n_elements(),
                want,
                ne: ne.to_vec(),
            });
        }
        let from = ggml_type(e.dtype).ok_or_else(|| {
            let (tensor, path) = tensor();
            LoadError::DType { tensor, path, dtype: e.dtype.name() }
        })?;
        files.check_unchanged(e.file)?;
        let stored = files.bytes(e);
        // 8-bit floats are widened to f16 first, as the reference loads them.
        let bytes = match crate::files::f8::widen_to_f16(e.dtype, stored) {
            Some(widened) => Cow::Owned(widened),
            None => Cow::Borrowed(stored),
        };
        if let Some(element) = first_non_finite(from, &bytes) {
            let (tensor, path) = tensor();
            return Err(LoadError::NonFinite { tensor, path, element });
        }
        if from == GgmlType::GGML_TYPE_F16 && saturated_f16(&bytes) {
            let (tensor, path) = tensor();
            return Err(LoadError::Saturated { tensor, path, elements: e.n_elements() });
        }
        if let Some((block, size, field)) = first_bad_scale(from, &bytes) {
            let (tensor, path) = tensor();
            let first = block as u64 * size;
            return Err(LoadError::NonFiniteScale { tensor, path, field, block, first, end: first + size });
        }
        if from == ty {
            return Ok(bytes);
        }
        convert::convert(from, ty, &bytes, ne).map(Cow::Owned).map_err(|source| {
            let (tensor, path) = tensor();
            LoadError::Convert { tensor, path, source }
        })
    }
}

/// Why [`FileSource`] could not deliver a tensor, naming the tensor and its file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// No file holds the tensor.
    #[error("tensor `{tensor}` is missing from the model files")]
    Missing { tensor: String },
    /// The element count disagrees with the architecture.
    #[error("tensor `{tensor}` in {path} has shape {shape:?} ({elements} elements); the architecture expects {want} elements (ggml ne {ne:?})")]
    Shape { tensor: String, path: String, shape: Vec<u64>, elements: u64, want: i64, ne: Vec<i64> },
    /// A stored type with no ggml type.
    #[error("tensor `{tensor}` in {path}: dtype {dtype} cannot be loaded")]
    DType { tensor: String, path: String, dtype: &'static str },
    /// The file changed since it was opened.
    #[error(transparent)]
    Changed(#[from] crate::files::FilesError),
    /// A float weight holds a NaN or an infinity.
    #[error("tensor `{tensor}` in {path} holds a NaN or infinite value (element {element})")]
    NonFinite { tensor: String, path: String, element: usize },
    /// An f16 weight whose every value is +-65504.
    #[error("tensor `{tensor}` in {path}: all {elements} values are +-65504, f16's largest (saturated, e.g. by an overflowing conversion; every output computed from it would be inf or NaN)")]
    Saturated { tensor: String, path: String, elements: u64 },
    /// A quantized weight's block scale is a NaN or an infinity (every element of the block
    /// would be).
    #[error("tensor `{tensor}` in {path} holds a NaN or infinite value (the scale `{field}` of block {block}: elements {first}..{end})")]
    NonFiniteScale { tensor: String, path: String, field: &'static str, block: usize, first: u64, end: u64 },
    /// The conversion to the requested type failed.
    #[error("tensor `{tensor}` in {path}")]
    Convert {
        tensor: String,
        path: String,
        #[source]
        source: convert::ConvertError,
    },
}

/// The page-aligned byte range `(offset, len)` lying wholly inside `offset..offset + len`,
/// if it holds at least one whole page. Pages a tensor shares with its neighbours stay
/// resident: a neighbour may be loaded next.
fn inner_pages(offset: u64, len: u64, page: u64) -> Option<(usize, usize)> {
    let start = offset.div_ceil(page) * page;
    let end = (offset + len) / page * page;
    (end > start).then(|| (start as usize, (end - start) as usize))
}

/// Drops the pages wholly inside `e`'s bytes from this process's resident set.
#[cfg(target_os = "linux")]
fn release_pages(files: &ModelFiles, e: &TensorEntry) {
    use memmap2::UncheckedAdvice;

    let Some(map) = files.mmap(e.file) else { return };
    // SAFETY: sysconf has no preconditions; it only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let Some((offset, len)) = u64::try_from(page).ok().filter(|&p| p > 0).and_then(|p| inner_pages(e.offset, e.len, p))
    else {
        return;
    };
    // SAFETY: `map` is a read-only shared mapping of a file (`Mmap::map`: PROT_READ,
    // MAP_SHARED), and `offset..offset + len` lies inside it (inside this entry's range,
    // checked at open). On such a mapping MADV_DONTNEED only removes this process's page-table
    // entries: the next read of those addresses faults the same bytes back in from the page
    // cache, so no value seen through a slice of the map changes. (memmap2 flags the advice
    // unsafe because on private or anonymous mappings the pages come back zeroed or lose
    // writes; neither applies here, and a concurrent rewrite of the file is excluded as for
    // the map itself, see `store::map_file`.) Besides, by the `release` contract the caller
    // has dropped the slice it borrowed for this tensor. The map's start is page-aligned
    // (file offset 0) and so is `offset`, so memmap2 does not widen the range.
    if let Err(err) = unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, offset, len) } {
        tracing::debug!(tensor = %e.name, %err, "madvise(MADV_DONTNEED) failed; the pages stay resident");
    }
}

/// Other systems keep the pages (the advice's semantics differ there).
#[cfg(not(target_os = "linux"))]
fn release_pages(_files: &ModelFiles, _e: &TensorEntry) {}

/// A type weights are converted to at load (`--type`): the ggml types a model's weights may
/// be stored in. Parsed from ggml's type name, ignoring ASCII case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadType(pub GgmlType);

impl LoadType {
    /// Every accepted type, by name, in the order messages list them.
    pub(crate) const ACCEPTED: [(&'static str, GgmlType); 13] = [
        ("f32", GgmlType::GGML_TYPE_F32),
        ("f16", GgmlType::GGML_TYPE_F16),
        ("bf16", GgmlType::GGML_TYPE_BF16),
        ("q8_0", GgmlType::GGML_TYPE_Q8_0),
        ("q5_0", GgmlType::GGML_TYPE_Q5_0),
        ("q5_1", GgmlType::GGML_TYPE_Q5_1),
        ("q4_0", GgmlType::GGML_TYPE_Q4_0),
        ("q4_1", GgmlType::GGML_TYPE_Q4_1),
        ("q2_k", GgmlType::GGML_TYPE_Q2_K),
        ("q3_k", GgmlType::GGML_TYPE_Q3_K),
        ("q4_k", GgmlType::GGML_TYPE_Q4_K),
        ("q5_k", GgmlType::GGML_TYPE_Q5_K),
        ("q6_k", GgmlType::GGML_TYPE_Q6_K),
    ];
}

/// A weight type name [`LoadType`] does not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown weight type '{given}' (accepted: {})", LoadType::ACCEPTED.map(|(n, _)| n).join(", "))]
pub struct UnknownLoadType {
    /// The name given.
    pub given: String,
}

impl std::str::FromStr for LoadType {
    type Err = UnknownLoadType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LoadType::ACCEPTED
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(s))
            .map(|&(_, ty)| LoadType(ty))
            .ok_or_else(|| UnknownLoadType { given: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_types_parse_ignoring_case_and_refusals_list_the_accepted() {
        assert_eq!("Q4_K".parse::<LoadType>(), Ok(LoadType(GgmlType::GGML_TYPE_Q4_K)));
        assert_eq!("f16".parse::<LoadType>(), Ok(LoadType(GgmlType::GGML_TYPE_F16)));
        for bad in ["q9_9", "", "iq2_xxs"] {
            let e = bad.parse::<LoadType>().unwrap_err().to_string();
            assert!(e.contains(&format!("'{bad}'")) && e.contains("f32, f16, bf16") && e.contains("q6_k"), "{e}");
        }
    }

    #[test]
    fn the_first_non_finite_value_is_found_in_every_float_type_and_block() {
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let n = 4096 * 2 + 17; // three blocks, the last partial
        for at in [0, 1, 4095, 4096, 8191, 8192, n - 1] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut v = vec![1.5f32; n];
                v[at] = bad;
                v[n - 1] = if at == n - 1 { bad } else { f32::MAX };
                assert_eq!(first_non_finite(GgmlType::GGML_TYPE_F32, &f32s(&v)), Some(at), "f32 {bad} at {at}");
                // f16 and bf16 infinities: 0x7c00 and 0x7f80 (NaNs have mantissa bits too)
                for (ty, inf, finite_max) in
                    [(GgmlType::GGML_TYPE_F16, 0x7c00u16, 0x7bffu16), (GgmlType::GGML_TYPE_BF16, 0x7f80, 0x7f7f)]
                {
                    let mut h = vec![finite_max; n];
                    h[at] = inf | if bad.is_nan() { 1 } else { 0 } | if bad < 0.0 { 0x8000 } else { 0 };
                    let bytes: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
                    assert_eq!(first_non_finite(ty, &bytes), Some(at), "{ty:?} at {at}");
                }
            }
        }
        assert_eq!(first_non_finite(GgmlType::GGML_TYPE_F32, &f32s(&vec![f32::MAX; n])), None);
        assert_eq!(first_non_finite(GgmlType::GGML_TYPE_F16, &[]), None);
        // quantized data is not scanned
        assert_eq!(first_non_finite(GgmlType::GGML_TYPE_Q8_0, &[0xff; 34]), None);
    }

    #[test]
    fn an_f16_weight_is_saturated_only_when_every_value_is_at_f16s_largest() {
        let h = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert!(saturated_f16(&h(&[0x7bff; 100])));
        assert!(saturated_f16(&h(&[0x7bff, 0xfbff, 0xfbff])));
        let mut one_real = vec![0x7bffu16; 100];
        one_real[99] = 0x3c00;
        assert!(!saturated_f16(&h(&one_real)));
        assert!(!saturated_f16(&h(&[0x7bfe; 4])));
        assert!(!saturated_f16(&[]));
    }

    #[test]
    fn a_non_finite_block_scale_is_found_in_every_quantized_type_where_ggml_would_compute_with_it() {
        let mut scanned = 0;
        for d in DType::ALL.into_iter().filter(|d| d.is_quantized() && d.is_compute_type()) {
            let ty = GgmlType(d.ggml_type_id().unwrap());
            let n = 3 * d.block_size() as i64;
            let zeros = vec![0u8; 3 * d.block_bytes() as usize];
            let Some(fields) = block_scales(ty) else {
                // Types without a scale that can be non-finite: their scales' largest codes
                // dequantize finite (mxfp4's 0xFF, 2^126, only overflows times quants of 12).
                for byte in [0x00, 0x7f, 0xfe, 0xff] {
                    let data: Vec<u8> = match d {
                        DType::MXFP4 => {
                            zeros.chunks(17).flat_map(|_| [[byte].as_slice(), &[0x11; 16]].concat()).collect()
                        }
                        _ => vec![byte; zeros.len()],
                    };
                    let f = convert::to_f32(ty, &data, n).unwrap();
                    assert!(f.iter().all(|x| x.is_finite()), "{d} from bytes {byte:#x}");
                }
                continue;
            };
            assert_eq!(first_bad_scale(ty, &zeros), None, "{d}");
            assert!(convert::to_f32(ty, &zeros, n).unwrap().iter().all(|x| x.is_finite()), "{d}");
            for &(name, at, code) in fields {
                let codes: &[&[u8]] = match code {
                    ScaleCode::F16 => &[&[0x00, 0x7e], &[0x00, 0x7c], &[0x00, 0xfc]],
                    // NaN (0x7fff) and -inf (0xfc00) as iq1_m spreads them.
                    ScaleCode::Iq1m => &[&[0, 0xf0, 0, 0xf0, 0, 0xf0, 0, 0x70], &[0, 0, 0, 0, 0, 0xc0, 0, 0xf0]],
                };
                for bad in codes {
                    let mut data = zeros.clone();
                    let o = d.block_bytes() as usize + at;
                    data[o..o + bad.len()].copy_from_slice(bad);
                    assert_eq!(first_bad_scale(ty, &data), Some((1, d.block_size(), name)), "{d} {name}");
                    // ggml itself computes non-finite values from it: the field is a scale.
                    let f = convert::to_f32(ty, &data, n).unwrap();
                    let bad_at = f.iter().position(|x| !x.is_finite());
                    assert!(
                        bad_at.is_some_and(|i| (d.block_size() as usize..2 * d.block_size() as usize).contains(&i)),
                        "{d} {name} {bad:?}: first non-finite value at {bad_at:?}"
                    );
                }
            }
            scanned += 1;
        }
        assert_eq!(scanned, 23, "every quantized type but q8_1, q8_K (refused), nvfp4 and mxfp4");
    }

    #[test]
    fn inner_pages_keeps_only_whole_pages_inside_the_tensor() {
        // (offset, len, page) -> range; the range may never leave offset..offset + len.
        let cases = [
            ((0, 8192, 4096), Some((0, 8192))),
            ((100, 8192, 4096), Some((4096, 4096))),
            ((4096, 4095, 4096), None),
            ((4000, 4192, 4096), Some((4096, 4096))),
            ((4001, 4190, 4096), None),
            ((4001, 4191, 4096), Some((4096, 4096))),
            ((10, 20, 4096), None),
            ((0, 0, 4096), None),
            ((70_000, 200_000, 65_536), Some((131_072, 131_072))),
        ];
        for ((offset, len, page), want) in cases {
            let got = inner_pages(offset, len, page);
            assert_eq!(got, want, "offset {offset}, len {len}, page {page}");
            if let Some((o, l)) = got {
                assert!(o as u64 >= offset && (o + l) as u64 <= offset + len);
                assert!((o as u64).is_multiple_of(page) && (l as u64).is_multiple_of(page));
            }
        }
    }

    /// Resident kB of this process's mapping of `path`, from /proc/self/smaps.
    #[cfg(target_os = "linux")]
    fn mapped_rss_kb(path: &std::path::Path) -> u64 {
        let path = path.canonicalize().unwrap();
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut total = 0;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
                inside = line.ends_with(path.to_str().unwrap());
            } else if inside && first == "Rss:" {
                total += line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap();
            }
        }
        total
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn release_drops_the_copied_pages_and_the_bytes_read_back_unchanged() {
        const N: usize = 1 << 20; // 4 MiB of f32
        let data: Vec<u8> = (0..N).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let json = format!(r#"{{"w":{{"dtype":"F32","shape":[{N}],"data_offsets":[0,{}]}}}}"#, data.len());
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.extend_from_slice(&data);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, &file).unwrap();

        let files = ModelFiles::open_model(&path).unwrap();
        let name = files.index().entries()[0].name.clone();
        let src = FileSource::new(&files);
        let ne = [N as i64];
        assert_eq!(&src.load(&name, GgmlType::GGML_TYPE_F32, &ne).unwrap()[..], &data[..]);
        let before = mapped_rss_kb(&path);
        assert!(before >= 3 * 1024, "reading the tensor should fault it in: {before} kB resident");

        src.release(&name);
        let after = mapped_rss_kb(&path);
        // SAFETY: sysconf has no preconditions.
        let page_kb = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64 / 1024;
        // At most the two pages the tensor shares with the header and the file's end.
        assert!(after <= 2 * page_kb, "{after} kB still resident after release (was {before} kB)");

        assert_eq!(&src.load(&name, GgmlType::GGML_TYPE_F32, &ne).unwrap()[..], &data[..]);
        src.release("not.a.tensor");
    }

    #[test]
    fn mapped_bytes_are_the_maps_own_when_no_conversion_is_needed_and_checked_like_a_load() {
        let n = 1024usize;
        let good: Vec<u8> = (0..n).flat_map(|i| (i as f32 * 0.5).to_le_bytes()).collect();
        let mut bad = good.clone();
        bad[4 * 700..4 * 701].copy_from_slice(&f32::NAN.to_le_bytes());
        let json = format!(
            r#"{{"good":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{l}]}},"bad":{{"dtype":"F32","shape":[{n}],"data_offsets":[{l},{l2}]}}}}"#,
            l = good.len(),
            l2 = 2 * good.len()
        );
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.extend_from_slice(&good);
        file.extend_from_slice(&bad);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        std::fs::write(&path, &file).unwrap();
        let files = ModelFiles::open_model(&path).unwrap();
        let name = |orig: &str| files.index().entries().iter().find(|e| e.original_name == orig).unwrap().name.clone();
        let src = FileSource::new(&files);
        let ne = [n as i64];

        // Stored as asked: the map's own bytes (the same address the loader would lend).
        let m = src.mapped_tensor(&name("good"), GgmlType::GGML_TYPE_F32, &ne).unwrap().expect("mapped");
        let lent = src.load_tensor(&name("good"), GgmlType::GGML_TYPE_F32, &ne).unwrap();
        assert_eq!(m.as_ptr(), lent.as_ptr());
        assert_eq!(m.len(), good.len());
        // A conversion makes new bytes: nothing to map.
        assert!(src.mapped_tensor(&name("good"), GgmlType::GGML_TYPE_F16, &ne).unwrap().is_none());
        // The load's checks hold: a NaN, a wrong element count.
        let err = src.mapped_tensor(&name("bad"), GgmlType::GGML_TYPE_F32, &ne).unwrap_err().to_string();
        assert!(err.contains("NaN") && err.contains("element 700"), "{err}");
        let err = src.mapped_tensor(&name("good"), GgmlType::GGML_TYPE_F32, &[n as i64 + 1]).unwrap_err().to_string();
        assert!(err.contains("elements"), "{err}");
    }

    #[test]
    fn eight_bit_floats_load_as_their_f16_values_and_a_nan_code_names_its_element() {
        use crate::files::f8;
        // Every e4m3fn code but the two NaNs, every finite e5m2 code, and an e4m3fn NaN.
        let e4: Vec<u8> = (0..=255u8).filter(|b| b & 0x7f != 0x7f).collect();
        let e5: Vec<u8> = (0..=255u8).filter(|b| (b >> 2) & 0x1f != 0x1f).collect();
        let mut nan = vec![0x38u8; 64];
        nan[41] = 0xff;
        use crate::files::safetensors::{to_bytes, HeaderEntry};
        let shapes = [[e4.len() as u64], [e5.len() as u64], [nan.len() as u64]];
        let tensors = [("e4", DType::F8_E4M3, &e4), ("e5", DType::F8_E5M2, &e5), ("nan", DType::F8_E4M3, &nan)];
        let entries: Vec<(HeaderEntry<'_>, &[u8])> = tensors
            .iter()
            .zip(&shapes)
            .map(|(&(name, dtype, bytes), shape)| (HeaderEntry { name, dtype, shape }, &bytes[..]))
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f8.safetensors");
        std::fs::write(&path, to_bytes(&entries, &Default::default()).unwrap()).unwrap();
        let files = ModelFiles::open_model(&path).unwrap();
        let name = |orig: &str| files.index().entries().iter().find(|e| e.original_name == orig).unwrap().name.clone();
        let src = FileSource::new(&files);

        // The loader's own type for them is f16 (what the weights' specs are built from).
        assert_eq!(dtype_of(&files)(&name("e4")), Some(GgmlType::GGML_TYPE_F16));
        let f16 = |codes: &[u8], widen: fn(u8) -> u16| -> Vec<u8> {
            codes.iter().flat_map(|&b| widen(b).to_le_bytes()).collect()
        };
        let ne = |v: &[u8]| [v.len() as i64];
        let got = src.load_tensor(&name("e4"), GgmlType::GGML_TYPE_F16, &ne(&e4)).unwrap();
        assert_eq!(&got[..], &f16(&e4, f8::e4m3fn_to_f16)[..]);
        let got = src.load_tensor(&name("e5"), GgmlType::GGML_TYPE_F16, &ne(&e5)).unwrap();
        assert_eq!(&got[..], &f16(&e5, f8::e5m2_to_f16)[..]);
        // Widened, then converted like an f16 tensor; never lent from the map.
        let got = src.load_tensor(&name("e4"), GgmlType::GGML_TYPE_F32, &ne(&e4)).unwrap();
        let want: Vec<u8> =
            e4.iter().flat_map(|&b| half::f16::from_bits(f8::e4m3fn_to_f16(b)).to_f32().to_le_bytes()).collect();
        assert_eq!(&got[..], &want[..]);
        assert!(src.mapped_tensor(&name("e4"), GgmlType::GGML_TYPE_F16, &ne(&e4)).unwrap().is_none());
        let err = src.load_tensor(&name("nan"), GgmlType::GGML_TYPE_F16, &ne(&nan)).unwrap_err().to_string();
        assert!(err.contains("NaN") && err.contains("element 41") && err.contains("`nan`"), "{err}");
    }
}

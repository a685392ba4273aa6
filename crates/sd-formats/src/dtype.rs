//! Element types of stored tensors: ggml's `enum ggml_type` plus the few safetensors-only types.
//!
//! The ggml ids, block sizes and bytes per block are facts of ggml's file format (ggml.h
//! `enum ggml_type`, ggml-common.h `block_*` structs, ggml.c `type_traits`). Ids that ggml has
//! removed (4, 5, 31..=33, 36..=38) and ids past the end are errors, never guesses.
//!
//! Safetensors can also hold 8-bit floats, `U8` and `BOOL`, which have no ggml type: they are
//! still indexed (the loader decides whether to convert or refuse them), and
//! [`DType::ggml_type_id`] returns `None` for them.

use std::fmt;
use std::str::FromStr;

/// One element type of a stored tensor.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
    Q2_0,
    /// safetensors `F8_E4M3` (no ggml type; sd.cpp widens it to f16 at load).
    F8_E4M3,
    /// safetensors `F8_E5M2` (no ggml type; sd.cpp widens it to f16 at load).
    F8_E5M2,
    /// safetensors `U8` (no ggml type).
    U8,
    /// safetensors `BOOL`, one byte per element (no ggml type).
    Bool,
}

/// Static facts of one type: ggml id, ggml name, elements per block, bytes per block.
struct Traits {
    id: Option<u32>,
    name: &'static str,
    block: u64,
    block_bytes: u64,
}

const QK_K: u64 = 256;

impl DType {
    /// Every type, in ggml id order, then the safetensors-only ones.
    pub const ALL: [DType; 39] = [
        DType::F32,
        DType::F16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
        DType::IQ2_XXS,
        DType::IQ2_XS,
        DType::IQ3_XXS,
        DType::IQ1_S,
        DType::IQ4_NL,
        DType::IQ3_S,
        DType::IQ2_S,
        DType::IQ4_XS,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::IQ1_M,
        DType::BF16,
        DType::TQ1_0,
        DType::TQ2_0,
        DType::MXFP4,
        DType::NVFP4,
        DType::Q1_0,
        DType::Q2_0,
        DType::F8_E4M3,
        DType::F8_E5M2,
        DType::U8,
        DType::Bool,
    ];

    fn traits(self) -> Traits {
        let t = |id: u32, name, block, block_bytes| Traits { id: Some(id), name, block, block_bytes };
        match self {
            DType::F32 => t(0, "f32", 1, 4),
            DType::F16 => t(1, "f16", 1, 2),
            DType::Q4_0 => t(2, "q4_0", 32, 18),
            DType::Q4_1 => t(3, "q4_1", 32, 20),
            DType::Q5_0 => t(6, "q5_0", 32, 22),
            DType::Q5_1 => t(7, "q5_1", 32, 24),
            DType::Q8_0 => t(8, "q8_0", 32, 34),
            DType::Q8_1 => t(9, "q8_1", 32, 36),
            DType::Q2_K => t(10, "q2_K", QK_K, 84),
            DType::Q3_K => t(11, "q3_K", QK_K, 110),
            DType::Q4_K => t(12, "q4_K", QK_K, 144),
            DType::Q5_K => t(13, "q5_K", QK_K, 176),
            DType::Q6_K => t(14, "q6_K", QK_K, 210),
            DType::Q8_K => t(15, "q8_K", QK_K, 292),
            DType::IQ2_XXS => t(16, "iq2_xxs", QK_K, 66),
            DType::IQ2_XS => t(17, "iq2_xs", QK_K, 74),
            DType::IQ3_XXS => t(18, "iq3_xxs", QK_K, 98),
            DType::IQ1_S => t(19, "iq1_s", QK_K, 50),
            DType::IQ4_NL => t(20, "iq4_nl", 32, 18),
            DType::IQ3_S => t(21, "iq3_s", QK_K, 110),
            DType::IQ2_S => t(22, "iq2_s", QK_K, 82),
            DType::IQ4_XS => t(23, "iq4_xs", QK_K, 136),
            DType::I8 => t(24, "i8", 1, 1),
            DType::I16 => t(25, "i16", 1, 2),
            DType::I32 => t(26, "i32", 1, 4),
            DType::I64 => t(27, "i64", 1, 8),
            DType::F64 => t(28, "f64", 1, 8),
            DType::IQ1_M => t(29, "iq1_m", QK_K, 56),
            DType::BF16 => t(30, "bf16", 1, 2),
            DType::TQ1_0 => t(34, "tq1_0", QK_K, 54),
            DType::TQ2_0 => t(35, "tq2_0", QK_K, 66),
            DType::MXFP4 => t(39, "mxfp4", 32, 17),
            DType::NVFP4 => t(40, "nvfp4", 64, 36),
            DType::Q1_0 => t(41, "q1_0", 128, 18),
            DType::Q2_0 => t(42, "q2_0", 64, 18),
            DType::F8_E4M3 => Traits { id: None, name: "f8_e4m3", block: 1, block_bytes: 1 },
            DType::F8_E5M2 => Traits { id: None, name: "f8_e5m2", block: 1, block_bytes: 1 },
            DType::U8 => Traits { id: None, name: "u8", block: 1, block_bytes: 1 },
            DType::Bool => Traits { id: None, name: "bool", block: 1, block_bytes: 1 },
        }
    }

    /// The `enum ggml_type` value, or `None` for the safetensors-only types.
    pub fn ggml_type_id(self) -> Option<u32> {
        self.traits().id
    }

    /// The type with this `enum ggml_type` value; `None` for removed or unknown ids.
    pub fn from_ggml_type_id(id: u32) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.ggml_type_id() == Some(id))
    }

    /// ggml's lower-case type name (`"q4_K"`, `"f16"`), also accepted by [`DType::from_str`].
    pub fn name(self) -> &'static str {
        self.traits().name
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.traits().block
    }

    /// Bytes per block (the element size for plain types).
    pub fn block_bytes(self) -> u64 {
        self.traits().block_bytes
    }

    /// Whether the type stores values in quantized blocks of more than one element.
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Whether model weights of this type can be computed with, in every role a weight has
    /// here: the weight of a matrix product (`mul_mat` src0), a table gathered by `get_rows`
    /// (token embeddings), or a tensor converted at load to the f16/f32 a convolution or norm
    /// takes. From ggml's type traits (the pinned llama-cpp-sys-2 0.1.161 source):
    /// `type_traits_cpu` (ggml-cpu.c) has a `vec_dot` for f32, f16, bf16 and every quantized
    /// type but q8_1 and q8_K, which are only the activation side of other types' products
    /// (no `vec_dot`; `ggml_backend_cpu_device_supports_op` still accepts them with an f32
    /// src1, and the product then calls a null function); `type_traits` (ggml.c) gives the
    /// same set a `to_float` (q8_1 and q8_K have none, so neither `get_rows` nor a conversion
    /// can read them: `ggml_compute_forward_get_rows` aborts on q8_K). So the three roles
    /// accept the same types, and a role-by-role check would refuse nothing more.
    /// Integer types, f64, `U8` and `BOOL` have neither (ggml's CPU `mul_mat` on an I8
    /// weight crashes). 8-bit floats count: they are computed with as f16 ([`DType::loaded`]).
    pub fn is_compute_type(self) -> bool {
        let d = self.loaded();
        matches!(d, DType::F32 | DType::F16 | DType::BF16)
            || (d.is_quantized() && d.ggml_type_id().is_some() && !matches!(d, DType::Q8_1 | DType::Q8_K))
    }

    /// The type a tensor stored as `self` has once loaded: f16 for the 8-bit floats, which
    /// the loader widens as stable-diffusion.cpp does ([`super::f8`]), else `self`.
    pub fn loaded(self) -> DType {
        match self {
            DType::F8_E4M3 | DType::F8_E5M2 => DType::F16,
            d => d,
        }
    }

    /// Bytes of a tensor of `shape` (outermost first) once loaded ([`DType::loaded`]), from its
    /// `stored_bytes`.
    pub fn loaded_bytes(self, stored_bytes: u64, shape: &[u64]) -> u64 {
        if self.loaded() == self {
            return stored_bytes;
        }
        let ne0 = shape.last().copied().unwrap_or(1);
        self.loaded().tensor_bytes(ne0, shape.iter().product()).unwrap_or(stored_bytes)
    }

    /// Bytes of one row of `n` elements; `None` when `n` is not a whole number of blocks or
    /// the size overflows `u64`.
    fn row_bytes(self, n: u64) -> Option<u64> {
        let t = self.traits();
        if !n.is_multiple_of(t.block) {
            return None;
        }
        (n / t.block).checked_mul(t.block_bytes)
    }

    /// Bytes of a tensor whose innermost (contiguous) dimension is `ne0` and which has
    /// `n_elements` elements in all; `None` when a row is not whole blocks or on overflow.
    pub fn tensor_bytes(self, ne0: u64, n_elements: u64) -> Option<u64> {
        if ne0 == 0 {
            return Some(0);
        }
        let rows = n_elements / ne0;
        self.row_bytes(ne0)?.checked_mul(rows)
    }

    /// The safetensors dtype string of this type, where safetensors has one.
    pub fn safetensors_name(self) -> Option<&'static str> {
        Some(match self {
            DType::F64 => "F64",
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I64 => "I64",
            DType::I32 => "I32",
            DType::I16 => "I16",
            DType::I8 => "I8",
            DType::U8 => "U8",
            DType::Bool => "BOOL",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E5M2 => "F8_E5M2",
            _ => return None,
        })
    }

    /// The type of a safetensors dtype string; `None` for strings we do not read (`U16`,
    /// `U32`, `U64`, `C64`, `F4`, ... or anything unknown).
    pub fn from_safetensors_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.safetensors_name() == Some(s))
    }

    /// The safetensors dtype strings [`DType::from_safetensors_name`] accepts, for messages.
    pub const SAFETENSORS_ACCEPTED: &'static str = "F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2";
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing a type name that no [`DType`] has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tensor type '{given}' (accepted: f32, f16, bf16, q8_0, q5_0, q5_1, q4_0, q4_1, q2_K..q6_K, ... any ggml type name)")]
pub struct UnknownDTypeName {
    /// The name that was given.
    pub given: String,
}

impl FromStr for DType {
    type Err = UnknownDTypeName;

    /// Parses ggml's type name, ignoring ASCII case (`q4_k` and `Q4_K` are `q4_K`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownDTypeName { given: s.to_owned() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (ggml id, elements per block, bytes per block), measured independently by compiling
    /// `sizeof(block_*)` and `QK*` from ggml-common.h (llama-cpp-sys-2 0.1.161's ggml) with gcc.
    const GGML_FACTS: &[(DType, u32, u64, u64)] = &[
        (DType::F32, 0, 1, 4),
        (DType::F16, 1, 1, 2),
        (DType::Q4_0, 2, 32, 18),
        (DType::Q4_1, 3, 32, 20),
        (DType::Q5_0, 6, 32, 22),
        (DType::Q5_1, 7, 32, 24),
        (DType::Q8_0, 8, 32, 34),
        (DType::Q8_1, 9, 32, 36),
        (DType::Q2_K, 10, 256, 84),
        (DType::Q3_K, 11, 256, 110),
        (DType::Q4_K, 12, 256, 144),
        (DType::Q5_K, 13, 256, 176),
        (DType::Q6_K, 14, 256, 210),
        (DType::Q8_K, 15, 256, 292),
        (DType::IQ2_XXS, 16, 256, 66),
        (DType::IQ2_XS, 17, 256, 74),
        (DType::IQ3_XXS, 18, 256, 98),
        (DType::IQ1_S, 19, 256, 50),
        (DType::IQ4_NL, 20, 32, 18),
        (DType::IQ3_S, 21, 256, 110),
        (DType::IQ2_S, 22, 256, 82),
        (DType::IQ4_XS, 23, 256, 136),
        (DType::I8, 24, 1, 1),
        (DType::I16, 25, 1, 2),
        (DType::I32, 26, 1, 4),
        (DType::I64, 27, 1, 8),
        (DType::F64, 28, 1, 8),
        (DType::IQ1_M, 29, 256, 56),
        (DType::BF16, 30, 1, 2),
        (DType::TQ1_0, 34, 256, 54),
        (DType::TQ2_0, 35, 256, 66),
        (DType::MXFP4, 39, 32, 17),
        (DType::NVFP4, 40, 64, 36),
        (DType::Q1_0, 41, 128, 18),
        (DType::Q2_0, 42, 64, 18),
    ];

    #[test]
    fn ggml_ids_and_block_sizes_match_ggml_common_h() {
        for &(d, id, block, bytes) in GGML_FACTS {
            assert_eq!(d.ggml_type_id(), Some(id), "{d}");
            assert_eq!(d.block_size(), block, "{d}");
            assert_eq!(d.block_bytes(), bytes, "{d}");
            assert_eq!(DType::from_ggml_type_id(id), Some(d));
        }
        // Every ggml type is in the table once.
        assert_eq!(DType::ALL.iter().filter(|d| d.ggml_type_id().is_some()).count(), GGML_FACTS.len());
    }

    #[test]
    fn removed_and_unknown_ggml_ids_are_rejected() {
        // ggml.h: 4, 5 (Q4_2/Q4_3), 31..=33 (Q4_0_4_4..), 36..=38 (IQ4_NL_4_4..) were removed;
        // GGML_TYPE_COUNT is 43.
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 43, 44, 1000, u32::MAX] {
            assert_eq!(DType::from_ggml_type_id(id), None, "id {id}");
        }
    }

    #[test]
    fn row_bytes_requires_whole_blocks() {
        // q8_0: 32 elements in 34 bytes; a 4096-wide row is 128 blocks.
        assert_eq!(DType::Q8_0.row_bytes(4096), Some(128 * 34));
        assert_eq!(DType::Q8_0.row_bytes(33), None);
        assert_eq!(DType::Q4_K.row_bytes(320), None, "320 is not a multiple of 256");
        assert_eq!(DType::F16.row_bytes(3), Some(6));
        assert_eq!(DType::F32.row_bytes(u64::MAX), None, "overflow");
        assert_eq!(DType::Q8_0.tensor_bytes(64, 64 * 3), Some(2 * 34 * 3));
        assert_eq!(DType::F32.tensor_bytes(0, 0), Some(0));
    }

    #[test]
    fn safetensors_names_round_trip_and_unknown_are_none() {
        for d in DType::ALL {
            if let Some(n) = d.safetensors_name() {
                assert_eq!(DType::from_safetensors_name(n), Some(d));
                assert!(DType::SAFETENSORS_ACCEPTED.contains(n));
            }
        }
        for bad in ["U16", "U32", "U64", "C64", "F4", "f32", "", "Q8_0"] {
            assert_eq!(DType::from_safetensors_name(bad), None, "{bad}");
        }
    }

    #[test]
    fn type_names_parse_case_insensitively() {
        assert_eq!("q4_k".parse::<DType>(), Ok(DType::Q4_K));
        assert_eq!("F16".parse::<DType>(), Ok(DType::F16));
        let err = "q9_9".parse::<DType>().unwrap_err();
        assert!(err.to_string().contains("q9_9"));
    }
}

//! The `--type` rule: which tensors a weight-type override converts, for every model here.
//!
//! stable-diffusion.cpp's model loader (`ModelLoader::tensor_should_be_converted` in its
//! `src/model_loader.cpp`) converts a tensor to the `--type` type unless it is a bias or a
//! scale, its name contains one of the embedding-like markers of the families it supports
//! (FLUX inputs and final layer, MMDiT embedders, the UNet's `time_embed.` / `label_emb.`,
//! any `embedding`), or the type is quantized and the tensor's rows are not a whole number
//! of its blocks. The UNet, the CLIP text encoders and the fixture writer all read this one
//! rule ([`converts`], [`keeps_file_type`]); the storage types derived from it
//! ([`loaded_type`], [`linear_weight_type`]) are the reference's `get_type` and its f32
//! fallback for linear layers, and [`SpecSink`] declares the parameters of the UNet and the
//! text encoders with them.

use sd_backends::convert::fits_blocks;
use sd_backends::GgmlType;
use sd_sched::TensorSpec;

/// Name fragments whose tensors keep their file type (the reference's lists for FLUX, MMDiT,
/// the UNet and embeddings, in its order).
const KEPT: [&str; 14] = [
    "img_in.",
    "txt_in.",
    "time_in.",
    "vector_in.",
    "guidance_in.",
    "final_layer.",
    "x_embedder.",
    "t_embedder.",
    "y_embedder.",
    "pos_embed",
    "context_embedder.",
    "time_embed.",
    "label_emb.",
    "embedding",
];

/// Whether `--type` leaves the tensor `name` in its file type whatever the type: biases,
/// scales and the embedding-like tensors of [`KEPT`].
pub fn keeps_file_type(name: &str) -> bool {
    name.ends_with(".bias")
        || name.ends_with(".scale")
        || name.ends_with(".weight_scale")
        || KEPT.iter().any(|k| name.contains(k))
}

/// Whether `--type ty` converts the tensor `name` whose rows have `ne0` elements.
pub fn converts(name: &str, ne0: i64, ty: GgmlType) -> bool {
    fits_blocks(ty, ne0) && !keeps_file_type(name)
}

/// The type a tensor is loaded in (the reference's `get_type`): the `--type` override
/// `wtype` where it [`converts`] the tensor, else the file's type `file`; f32 for a tensor
/// the file does not have.
pub fn loaded_type(name: &str, ne0: i64, file: Option<GgmlType>, wtype: Option<GgmlType>) -> GgmlType {
    match (file, wtype) {
        (None, _) => GgmlType::GGML_TYPE_F32,
        (Some(_), Some(w)) if converts(name, ne0, w) => w,
        (Some(f), _) => f,
    }
}

/// Storage type of a linear layer's weight `name` with `in_features` inputs: its
/// [`loaded_type`], or f32 when the row length is not a whole number of that type's blocks.
pub fn linear_weight_type(name: &str, in_features: i64, file: Option<GgmlType>, wtype: Option<GgmlType>) -> GgmlType {
    let ty = loaded_type(name, in_features, file, wtype);
    if fits_blocks(ty, in_features) {
        ty
    } else {
        GgmlType::GGML_TYPE_F32
    }
}

/// Collects parameter specs with the storage-type rules applied: the one spec builder of the
/// UNet and the text encoders.
pub struct SpecSink<'a> {
    /// The specs so far, in declaration order.
    pub specs: Vec<TensorSpec>,
    dtype_of: &'a dyn Fn(&str) -> Option<GgmlType>,
    wtype: Option<GgmlType>,
}

impl std::fmt::Debug for SpecSink<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SpecSink({} specs, wtype {:?})", self.specs.len(), self.wtype)
    }
}

impl<'a> SpecSink<'a> {
    /// A sink asking `dtype_of` for the file's type of each tensor, with the `--type` override `wtype`.
    pub fn new(dtype_of: &'a dyn Fn(&str) -> Option<GgmlType>, wtype: Option<GgmlType>) -> Self {
        Self { specs: Vec::new(), dtype_of, wtype }
    }

    /// One tensor of type `ty` and shape `ne` (innermost first), as given.
    pub fn push(&mut self, name: String, ty: GgmlType, ne: &[i64]) {
        self.specs.push(TensorSpec { name, ty, ne: ne.to_vec() });
    }

    /// `nn.Linear(inp, out)`: weight [inp, out] in the file's / override type, bias [out] f32.
    pub fn linear(&mut self, p: &str, inp: i64, out: i64, bias: bool) {
        let name = format!("{p}.weight");
        let ty = linear_weight_type(&name, inp, (self.dtype_of)(&name), self.wtype);
        self.push(name, ty, &[inp, out]);
        if bias {
            self.push(format!("{p}.bias"), GgmlType::GGML_TYPE_F32, &[out]);
        }
    }

    /// `nn.Conv2d(inp, out, k)` with bias: kernel [k, k, inp, out] f16, bias [out] f32.
    pub fn conv2d(&mut self, p: &str, inp: i64, out: i64, k: i64) {
        self.push(format!("{p}.weight"), GgmlType::GGML_TYPE_F16, &[k, k, inp, out]);
        self.push(format!("{p}.bias"), GgmlType::GGML_TYPE_F32, &[out]);
    }

    /// GroupNorm / LayerNorm affine parameters, f32.
    pub fn norm(&mut self, p: &str, c: i64) {
        self.push(format!("{p}.weight"), GgmlType::GGML_TYPE_F32, &[c]);
        self.push(format!("{p}.bias"), GgmlType::GGML_TYPE_F32, &[c]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const F16: GgmlType = GgmlType::GGML_TYPE_F16;
    const Q8_0: GgmlType = GgmlType::GGML_TYPE_Q8_0;

    /// The reference's rule, case by case: one name per branch of
    /// `tensor_should_be_converted`, on UNet, CLIP and VAE names.
    #[test]
    fn converts_what_the_reference_converts() {
        let cases: [(&str, i64, GgmlType, bool); 16] = [
            ("model.diffusion_model.input_blocks.1.1.proj_in.weight", 320, Q8_0, true),
            ("model.diffusion_model.input_blocks.1.1.proj_in.bias", 320, Q8_0, false),
            ("model.diffusion_model.time_embed.0.weight", 320, Q8_0, false),
            ("model.diffusion_model.label_emb.0.0.weight", 2816, Q8_0, false),
            ("model.diffusion_model.out.2.weight", 320, F16, true),
            ("x.norm.scale", 64, F16, false),
            ("x.weight_scale", 64, F16, false),
            ("double_blocks.0.img_in.weight", 64, F16, false),
            ("final_layer.linear.weight", 64, F16, false),
            ("x_embedder.proj.weight", 64, F16, false),
            ("pos_embed", 64, F16, false),
            ("cond_stage_model.transformer.text_model.embeddings.token_embedding.weight", 768, Q8_0, false),
            ("cond_stage_model.transformer.text_model.encoder.layers.0.mlp.fc1.weight", 768, Q8_0, true),
            // "final_layer." with its dot: CLIP's final LayerNorm is converted like any weight.
            ("cond_stage_model.transformer.text_model.final_layer_norm.weight", 768, F16, true),
            // A quantized type needs whole blocks (32 values for q8_0); f16 takes any row.
            ("first_stage_model.decoder.conv_in.weight", 3 * 3 * 4, Q8_0, false),
            ("first_stage_model.decoder.conv_in.weight", 3 * 3 * 4, F16, true),
        ];
        for (name, ne0, ty, want) in cases {
            assert_eq!(converts(name, ne0, ty), want, "{name} (rows of {ne0}) to {ty:?}");
        }
    }

    #[test]
    fn storage_types_follow_the_file_and_fall_back_to_f32() {
        let f32 = GgmlType::GGML_TYPE_F32;
        assert_eq!(loaded_type("a.weight", 64, None, Some(F16)), f32, "a tensor the file lacks is f32");
        assert_eq!(loaded_type("a.weight", 64, Some(f32), None), f32, "no override keeps the file type");
        assert_eq!(loaded_type("a.weight", 64, Some(f32), Some(Q8_0)), Q8_0);
        assert_eq!(loaded_type("a.bias", 64, Some(f32), Some(Q8_0)), f32);
        assert_eq!(linear_weight_type("a.weight", 40, Some(Q8_0), None), f32, "q8_0 file rows of 40 are not blocks");
        assert_eq!(linear_weight_type("a.weight", 64, Some(Q8_0), None), Q8_0);
    }
}

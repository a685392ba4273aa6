//! Graph-building operations: thin, typed wrappers over ggml's op constructors.
//!
//! Every op is a method on the [`Context`] that receives the result tensor
//! (usually a metadata-only graph context); operands may come from any live
//! context (weights live in their own). Shapes follow ggml: `ne[0]` is the
//! innermost (fastest) dimension. ggml asserts on shape mismatches, which would
//! abort the process: model code validates file shapes against the architecture
//! before it builds graphs, so a mismatch here is our bug.

use ggml_sys as sys;

use crate::context::{Context, GgmlType, Tensor};

macro_rules! unary {
    ($($(#[$m:meta])* $name:ident => $f:ident;)*) => {$(
        $(#[$m])*
        pub fn $name<'c>(&'c self, a: Tensor<'_>) -> Tensor<'c> {
            // SAFETY: live context and operand.
            Tensor::from_raw(unsafe { sys::$f(self.as_raw(), a.as_raw()) })
        }
    )*};
}

macro_rules! binary {
    ($($(#[$m:meta])* $name:ident => $f:ident;)*) => {$(
        $(#[$m])*
        pub fn $name<'c>(&'c self, a: Tensor<'_>, b: Tensor<'_>) -> Tensor<'c> {
            // SAFETY: live context and operands.
            Tensor::from_raw(unsafe { sys::$f(self.as_raw(), a.as_raw(), b.as_raw()) })
        }
    )*};
}

/// Interpolation modes for [`Context::upscale`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleMode {
    /// Nearest neighbour.
    Nearest,
    /// Bilinear.
    Bilinear,
}

impl Context {
    unary! {
        /// SiLU.
        silu => ggml_silu;
        /// GELU (tanh approximation, as ggml computes it).
        gelu => ggml_gelu;
        /// GELU with the erf formula.
        gelu_erf => ggml_gelu_erf;
        /// Quick GELU (x * sigmoid(1.702 x)), used by CLIP ViT-L.
        gelu_quick => ggml_gelu_quick;
        /// GEGLU: splits ne[0] in halves, returns gelu(first half) * second half.
        geglu => ggml_geglu;
        /// ReLU.
        relu => ggml_relu;
        /// tanh.
        tanh => ggml_tanh;
        /// Sigmoid.
        sigmoid => ggml_sigmoid;
        /// Softmax over ne[0].
        soft_max => ggml_soft_max;
        /// Makes a contiguous copy.
        cont => ggml_cont;
        /// Swaps the first two dimensions (a view).
        transpose => ggml_transpose;
        /// exp.
        exp => ggml_exp;
        /// sqrt.
        sqrt => ggml_sqrt;
        /// Square.
        sqr => ggml_sqr;
        /// Negation.
        neg => ggml_neg;
        /// sin.
        sin => ggml_sin;
        /// cos.
        cos => ggml_cos;
        /// Mean over ne[0].
        mean => ggml_mean;
        /// Sum over ne[0].
        sum_rows => ggml_sum_rows;
        /// A copy.
        dup => ggml_dup;
        /// Index of the maximum over ne[0].
        argmax => ggml_argmax;
    }

    binary! {
        /// a + b (b broadcast to a).
        add => ggml_add;
        /// a - b (b broadcast to a).
        sub => ggml_sub;
        /// a * b elementwise (b broadcast to a).
        mul => ggml_mul;
        /// a / b elementwise (b broadcast to a).
        div => ggml_div;
        /// Matrix product: result[i, j] = sum_k a[k, i] * b[k, j] (a is the weight).
        mul_mat => ggml_mul_mat;
        /// Repeats a to the shape of b.
        repeat => ggml_repeat;
        /// Rows of a selected by the i32 indices b.
        get_rows => ggml_get_rows;
        /// Copies a into b (converting types); returns a view of b.
        cpy => ggml_cpy;
    }

    /// a * s.
    pub fn scale<'c>(&'c self, a: Tensor<'_>, s: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_scale(self.as_raw(), a.as_raw(), s) })
    }

    /// Leaky ReLU: `x` where positive, `slope * x` elsewhere; `inplace` writes over `a`
    /// (ESRGAN's activations, as stable-diffusion.cpp builds them).
    pub fn leaky_relu<'c>(&'c self, a: Tensor<'_>, slope: f32, inplace: bool) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_leaky_relu(self.as_raw(), a.as_raw(), slope, inplace) })
    }

    /// Clamps to [min, max].
    pub fn clamp<'c>(&'c self, a: Tensor<'_>, min: f32, max: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_clamp(self.as_raw(), a.as_raw(), min, max) })
    }

    /// Layer normalisation over ne[0] without affine parameters.
    pub fn norm<'c>(&'c self, a: Tensor<'_>, eps: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_norm(self.as_raw(), a.as_raw(), eps) })
    }

    /// L2 normalisation over ne[0]: `a / max(sqrt(sum(a^2)), eps)`.
    pub fn l2_norm<'c>(&'c self, a: Tensor<'_>, eps: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_l2_norm(self.as_raw(), a.as_raw(), eps) })
    }

    /// Repeats `a` to the shape `ne` (each a multiple of `a`'s).
    pub fn repeat_4d<'c>(&'c self, a: Tensor<'_>, ne: [i64; 4]) -> Tensor<'c> {
        // SAFETY: live context and operand; ggml checks that `ne` is a whole repeat of `a`.
        Tensor::from_raw(unsafe { sys::ggml_repeat_4d(self.as_raw(), a.as_raw(), ne[0], ne[1], ne[2], ne[3]) })
    }

    /// RMS normalisation over ne[0] without a weight: `a / sqrt(mean(a^2) + eps)`.
    pub fn rms_norm<'c>(&'c self, a: Tensor<'_>, eps: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_rms_norm(self.as_raw(), a.as_raw(), eps) })
    }

    /// Rotary position embedding in the NeoX layout (pairs `i` and `i + n_dims/2` of ne[0]),
    /// without YaRN scaling: a `[D, H, L, N]`, `pos` i32 `[L]`; angle `pos * base^(-2i/n_dims)`.
    /// `n_ctx_orig` only matters to YaRN and is passed through as the model's own.
    pub fn rope_neox<'c>(
        &'c self,
        a: Tensor<'_>,
        pos: Tensor<'_>,
        n_dims: i32,
        n_ctx_orig: i32,
        base: f32,
    ) -> Tensor<'c> {
        self.rope_mode(a, pos, n_dims, sys::GGML_ROPE_TYPE_NEOX as i32, n_ctx_orig, base)
    }

    /// Rotary position embedding in the original (GPT-J, "normal") layout: pairs `2i` and
    /// `2i + 1` of ne[0] rotate together; otherwise as [`Context::rope_neox`].
    pub fn rope_normal<'c>(
        &'c self,
        a: Tensor<'_>,
        pos: Tensor<'_>,
        n_dims: i32,
        n_ctx_orig: i32,
        base: f32,
    ) -> Tensor<'c> {
        self.rope_mode(a, pos, n_dims, sys::GGML_ROPE_TYPE_NORMAL as i32, n_ctx_orig, base)
    }

    fn rope_mode<'c>(
        &'c self,
        a: Tensor<'_>,
        pos: Tensor<'_>,
        n_dims: i32,
        mode: i32,
        n_ctx_orig: i32,
        base: f32,
    ) -> Tensor<'c> {
        // SAFETY: live context and operands; no frequency-factor tensor (null).
        Tensor::from_raw(unsafe {
            sys::ggml_rope_ext(
                self.as_raw(),
                a.as_raw(),
                pos.as_raw(),
                std::ptr::null_mut(),
                n_dims,
                mode,
                n_ctx_orig,
                base,
                1.0,
                0.0,
                1.0,
                32.0,
                1.0,
            )
        })
    }

    /// Group normalisation over (ne[0], ne[1], ne[2]/groups) without affine parameters.
    pub fn group_norm<'c>(&'c self, a: Tensor<'_>, groups: i32, eps: f32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_group_norm(self.as_raw(), a.as_raw(), groups, eps) })
    }

    /// 2-D convolution (im2col + matmul). Kernel [KW, KH, IC, OC], data [W, H, C, N].
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d<'c>(
        &'c self,
        kernel: Tensor<'_>,
        data: Tensor<'_>,
        s0: i32,
        s1: i32,
        p0: i32,
        p1: i32,
        d0: i32,
        d1: i32,
    ) -> Tensor<'c> {
        // SAFETY: live context and operands.
        Tensor::from_raw(unsafe {
            sys::ggml_conv_2d(self.as_raw(), kernel.as_raw(), data.as_raw(), s0, s1, p0, p1, d0, d1)
        })
    }

    /// 2-D convolution computed directly (no im2col buffer).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_2d_direct<'c>(
        &'c self,
        kernel: Tensor<'_>,
        data: Tensor<'_>,
        s0: i32,
        s1: i32,
        p0: i32,
        p1: i32,
        d0: i32,
        d1: i32,
    ) -> Tensor<'c> {
        // SAFETY: live context and operands.
        Tensor::from_raw(unsafe {
            sys::ggml_conv_2d_direct(self.as_raw(), kernel.as_raw(), data.as_raw(), s0, s1, p0, p1, d0, d1)
        })
    }

    /// im2col.
    #[allow(clippy::too_many_arguments)]
    pub fn im2col<'c>(
        &'c self,
        kernel: Tensor<'_>,
        data: Tensor<'_>,
        s0: i32,
        s1: i32,
        p0: i32,
        p1: i32,
        d0: i32,
        d1: i32,
        is_2d: bool,
        ty: GgmlType,
    ) -> Tensor<'c> {
        // SAFETY: live context and operands.
        Tensor::from_raw(unsafe {
            sys::ggml_im2col(self.as_raw(), kernel.as_raw(), data.as_raw(), s0, s1, p0, p1, d0, d1, is_2d, ty)
        })
    }

    /// Softmax of a * scale + mask (mask optional, broadcast over rows).
    pub fn soft_max_ext<'c>(
        &'c self,
        a: Tensor<'_>,
        mask: Option<Tensor<'_>>,
        scale: f32,
        max_bias: f32,
    ) -> Tensor<'c> {
        let m = mask.map_or(std::ptr::null_mut(), |m| m.as_raw());
        // SAFETY: live context and operands (mask may be null).
        Tensor::from_raw(unsafe { sys::ggml_soft_max_ext(self.as_raw(), a.as_raw(), m, scale, max_bias) })
    }

    /// Fused attention. q [D, Lq, H, N], k/v [D, Lk, H, N] (k/v f16 on most backends);
    /// result [D, H, Lq, N]. Accumulates in f32.
    pub fn flash_attn_ext<'c>(
        &'c self,
        q: Tensor<'_>,
        k: Tensor<'_>,
        v: Tensor<'_>,
        mask: Option<Tensor<'_>>,
        scale: f32,
    ) -> Tensor<'c> {
        let m = mask.map_or(std::ptr::null_mut(), |m| m.as_raw());
        // SAFETY: live context and operands (mask may be null).
        let t =
            unsafe { sys::ggml_flash_attn_ext(self.as_raw(), q.as_raw(), k.as_raw(), v.as_raw(), m, scale, 0.0, 0.0) };
        // SAFETY: t is a flash-attention node just created.
        unsafe { sys::ggml_flash_attn_ext_set_prec(t, sys::ggml_prec::GGML_PREC_F32) };
        Tensor::from_raw(t)
    }

    /// Upscales ne[0] and ne[1] by an integer factor.
    pub fn upscale<'c>(&'c self, a: Tensor<'_>, factor: i32, mode: ScaleMode) -> Tensor<'c> {
        let m = match mode {
            ScaleMode::Nearest => sys::ggml_scale_mode::GGML_SCALE_MODE_NEAREST,
            ScaleMode::Bilinear => sys::ggml_scale_mode::GGML_SCALE_MODE_BILINEAR,
        };
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_upscale(self.as_raw(), a.as_raw(), factor, m) })
    }

    /// Zero-pads at the end of each dimension.
    pub fn pad<'c>(&'c self, a: Tensor<'_>, p: [i32; 4]) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_pad(self.as_raw(), a.as_raw(), p[0], p[1], p[2], p[3]) })
    }

    /// Concatenates along `dim`.
    pub fn concat<'c>(&'c self, a: Tensor<'_>, b: Tensor<'_>, dim: i32) -> Tensor<'c> {
        // SAFETY: live context and operands.
        Tensor::from_raw(unsafe { sys::ggml_concat(self.as_raw(), a.as_raw(), b.as_raw(), dim) })
    }

    /// Sinusoidal timestep embedding [dim, N] of timesteps [N].
    pub fn timestep_embedding<'c>(&'c self, t: Tensor<'_>, dim: i32, max_period: i32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_timestep_embedding(self.as_raw(), t.as_raw(), dim, max_period) })
    }

    /// Reorders dimensions: axis i of `a` becomes axis `axes[i]` of the result (a view).
    pub fn permute<'c>(&'c self, a: Tensor<'_>, axes: [i32; 4]) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_permute(self.as_raw(), a.as_raw(), axes[0], axes[1], axes[2], axes[3]) })
    }

    /// Reshapes a contiguous tensor (a view) to 1 to 4 dims.
    pub fn reshape<'c>(&'c self, a: Tensor<'_>, ne: &[i64]) -> Tensor<'c> {
        let r = a.as_raw();
        let c = self.as_raw();
        // SAFETY: live context and operand; ggml checks the element count.
        let t = unsafe {
            match *ne {
                [a0] => sys::ggml_reshape_1d(c, r, a0),
                [a0, a1] => sys::ggml_reshape_2d(c, r, a0, a1),
                [a0, a1, a2] => sys::ggml_reshape_3d(c, r, a0, a1, a2),
                [a0, a1, a2, a3] => sys::ggml_reshape_4d(c, r, a0, a1, a2, a3),
                _ => panic!("reshape takes 1 to 4 dimensions"),
            }
        };
        Tensor::from_raw(t)
    }

    /// A view of `a` with shape `ne`, byte strides `nb[1..]` and byte offset.
    pub fn view<'c>(&'c self, a: Tensor<'_>, ne: [i64; 4], nb: [usize; 3], offset: usize) -> Tensor<'c> {
        // SAFETY: live context and operand; ggml checks the view lies within a.
        Tensor::from_raw(unsafe {
            sys::ggml_view_4d(self.as_raw(), a.as_raw(), ne[0], ne[1], ne[2], ne[3], nb[0], nb[1], nb[2], offset)
        })
    }

    /// Converts to another type.
    pub fn cast<'c>(&'c self, a: Tensor<'_>, ty: GgmlType) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_cast(self.as_raw(), a.as_raw(), ty) })
    }

    /// Sets every element above the diagonal shifted by `n_past` (ne[0] index > n_past +
    /// ne[1] index) to -inf: a causal mask applied in place of adding a 0/-inf mask tensor.
    pub fn diag_mask_inf<'c>(&'c self, a: Tensor<'_>, n_past: i32) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_diag_mask_inf(self.as_raw(), a.as_raw(), n_past) })
    }

    /// Matrix product like [`Context::mul_mat`], asking backends that can lower precision
    /// (CUDA's f16 GEMM) to accumulate in f32 (`ggml_mul_mat_set_prec(GGML_PREC_F32)`).
    pub fn mul_mat_prec_f32<'c>(&'c self, a: Tensor<'_>, b: Tensor<'_>) -> Tensor<'c> {
        // SAFETY: live context and operands.
        let t = unsafe { sys::ggml_mul_mat(self.as_raw(), a.as_raw(), b.as_raw()) };
        // SAFETY: t is a mul_mat node just created.
        unsafe { sys::ggml_mul_mat_set_prec(t, sys::ggml_prec::GGML_PREC_F32) };
        Tensor::from_raw(t)
    }

    /// GEGLU with the halves swapped: splits ne[0] into a | b and returns a * gelu(b)
    /// (ggml's tanh GELU), the order of the LDM/diffusers `GEGLU` feed-forward. On the CPU
    /// it computes exactly `mul(a, gelu(cont(b)))` in one pass.
    pub fn geglu_swapped<'c>(&'c self, a: Tensor<'_>) -> Tensor<'c> {
        // SAFETY: live context and operand.
        Tensor::from_raw(unsafe { sys::ggml_geglu_swapped(self.as_raw(), a.as_raw()) })
    }

    /// `a` itself when it is contiguous, else a contiguous copy (saves a copy node when a
    /// permutation happens to keep the memory order).
    pub fn cont_if_needed<'c>(&'c self, a: Tensor<'c>) -> Tensor<'c> {
        // SAFETY: a live tensor.
        if unsafe { sys::ggml_is_contiguous(a.as_raw()) } {
            a
        } else {
            self.cont(a)
        }
    }
}

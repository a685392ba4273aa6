//! stable-diffusion.cpp's flags, for the answer to one this program lacks.
//!
//! An unknown flag that the reference's `sd-cli` takes is refused as "not implemented by
//! sd-rs" (as `-M vid_gen` is), never with clap's "a similar argument exists" guess, which
//! pointed `--control-net` at `--control-net-cpu` and `--fa` at `--offload-to-cpu`.

/// Every flag of stable-diffusion.cpp's `sd-cli` (`examples/common/common.cpp` and
/// `examples/cli/main.cpp` of leejet/stable-diffusion.cpp, read 2026-08), long and short.
/// Those this program has never reach [`not_implemented`]: clap takes them first.
#[rustfmt::skip]
const REFERENCE: &[&str] = &[
    "--ad-model", "--ad-negative-prompt", "--ad-prompt", "--audio-vae", "--auto-fit", "--backend", "--cache-mode",
    "--cache-option", "--cfg-scale", "--circular", "--circularx", "--circulary", "--clip-on-cpu",
    "--clip-skip", "--clip_g", "--clip_l", "--clip_vision", "--color", "--control-video", "--convert-name", "--diffusion-conv-direct",
    "--diffusion-fa", "--diffusion-model", "--disable-auto-resize-ref-image", "--disable-image-metadata",
    "--eager-load", "--embd-dir", "--embeddings-connectors", "--end-img", "--eta", "--extra-ad-args",
    "--extra-sample-args", "--extra-tiling-args", "--fa", "--flow-shift", "--force-sdxl-vae-conv-scale", "--fps",
    "--guidance", "--high-noise-cfg-scale", "--high-noise-diffusion-model", "--high-noise-eta",
    "--high-noise-guidance", "--high-noise-img-cfg-scale", "--high-noise-sampling-method",
    "--high-noise-skip-layer-end", "--high-noise-skip-layer-start", "--high-noise-skip-layers",
    "--high-noise-slg-scale", "--high-noise-steps", "--hires-sigmas", "--image", "--imat-in", "--imat-out", "--img-cfg-scale",
    "--increase-ref-index", "--ip-adapter", "--ip-adapter-image", "--ip-adapter-strength", "--list-devices", "--llm",
    "--llm_vision", "--lora-apply-mode", "--lora-model-dir", "--mask", "--max-vram", "--metadata-all",
    "--metadata-brief", "--metadata-format", "--metadata-raw", "--mmap", "--model-args", "--moe-boundary",
    "--motion-module", "--negative-prompt-file", "--offload-to-cpu", "--output-begin-idx", "--params-backend",
    "--photo-maker", "--pm-id-embed-path", "--pm-id-images-dir", "--pm-style-strength", "--prediction", "--preview",
    "--preview-interval", "--preview-noisy", "--preview-path", "--prompt-file", "--pulid-id-embedding",
    "--pulid-id-weight", "--pulid-weights", "--qwen-image-layers", "--qwen2vl", "--qwen2vl_vision", "--ref-audio",
    "--ref-image-args", "--ref-video", "--ref-video-audio", "--rng", "--rpc-servers", "--sampler-rng",
    "--sampling-method", "--scheduler", "--scm-mask", "--scm-policy", "--sigmas", "--skip-layer-end",
    "--skip-layer-start", "--skip-layers", "--slg-scale", "--split-mode", "--steps", "--stream-layers", "--strength",
    "--t5xxl", "--tae", "--taesd", "--taesd-preview-only", "--temporal-tiling", "--tensor-type-rules",
    "--timestep-shift", "--type", "--uncond-diffusion-model", "--upscale-model", "--upscale-repeats",
    "--upscale-tile-size", "--vace-strength", "--vae", "--vae-conv-direct", "--vae-format", "--vae-on-cpu",
    "--vae-relative-tile-size", "--vae-tile-overlap", "--vae-tile-size", "--vae-tiling", "--video-frames", "-H",
    "--height", "-M", "--mode", "-W", "--width", "-b", "--batch-count", "-h", "--help", "-i", "--init-img", "-m",
    "--model", "-n", "--negative-prompt", "-o", "--output", "-p", "--prompt", "-r", "--ref-image", "-s", "--seed", "-t",
    "--threads", "-v", "--verbose",
];

/// The message for `arg`, an argument clap refused as unknown (`--fa`, `--control-net=x`),
/// when it is a flag of the reference; `None` for any other argument (clap's own message
/// stands).
pub fn not_implemented(arg: &str) -> Option<String> {
    let flag = arg.split_once('=').map_or(arg, |(f, _)| f).trim();
    REFERENCE.contains(&flag).then(|| {
        format!(
            "{flag}: a flag of stable-diffusion.cpp's sd-cli that is not implemented by sd-rs \
             (`sd-cli --help` lists the flags it takes)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::not_implemented;

    #[test]
    fn reference_flags_are_named_and_others_are_not() {
        let m = not_implemented("--control-video").expect("a reference flag");
        assert!(m.starts_with("--control-video: ") && m.contains("not implemented by sd-rs"), "{m}");
        assert!(not_implemented("--fa=1").is_some_and(|m| m.starts_with("--fa: ")));
        assert!(not_implemented("--img-cfg-scale").is_some());
        assert_eq!(not_implemented("--no-such-flag"), None);
        assert_eq!(not_implemented("--control"), None);
    }
}

//! AutoencoderKL and TAESD decoders/encoders with tiling.

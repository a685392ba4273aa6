//! The web page served at `/`: one HTML file with its script, embedded in the binary.
//!
//! It asks the server's own APIs for everything (samplers, LoRAs, defaults), submits native
//! jobs and follows them through their server-sent events (progress bar, live preview, the
//! images). The page itself holds no data, so it is served without the API key; the key
//! typed into it goes with each of its API calls.

/// The page's HTML.
pub(crate) const INDEX_HTML: &str = include_str!("page/index.html");

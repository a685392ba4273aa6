//! Opening files a user names: regular files only, opened without blocking, read with a size cap.
//!
//! Every file this crate (and `sd-cli`) parses is opened through [`open_regular`]: the open
//! never blocks (`O_NONBLOCK`, so a FIFO without a writer cannot hang us), and anything that
//! is not a regular file (FIFO, character or block device, socket, directory) is refused with
//! an error naming the path and what it is. Small text files (device profiles, diffusers JSON)
//! are read whole with [`read_text`], which refuses files over a stated cap instead of reading
//! `/dev/zero`-like inputs without bound.

use std::fs::{File, Metadata};
use std::io::Read;
use std::path::Path;

use super::error::FilesError;

/// What kind of file system object `meta` describes, for messages ("a FIFO").
pub fn kind_of(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_file() {
        return "a regular file";
    }
    if t.is_dir() {
        return "a directory";
    }
    if t.is_symlink() {
        return "a symbolic link";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "not a regular file"
}

/// Opens `path` for reading without blocking and checks that it is a regular file.
pub fn open_regular(path: &Path) -> Result<(File, Metadata), FilesError> {
    let io = |error| FilesError::Io { path: path.to_owned(), error };
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // A FIFO opened for reading blocks until a writer appears; O_NONBLOCK returns at once.
        // On a regular file the flag has no effect on reads.
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        return Err(FilesError::NotRegular { path: path.to_owned(), kind: kind_of(&meta) });
    }
    Ok((file, meta))
}

/// Reads the regular file `path` as UTF-8 text, refusing files over `limit` bytes.
pub fn read_text(path: &Path, limit: u64) -> Result<String, FilesError> {
    let (file, meta) = open_regular(path)?;
    if meta.len() > limit {
        return Err(FilesError::TooLarge { path: path.to_owned(), len: meta.len(), limit });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // `take` keeps the bound even if the file grows while we read it.
    file.take(limit + 1).read_to_end(&mut bytes).map_err(|error| FilesError::Io { path: path.to_owned(), error })?;
    if bytes.len() as u64 > limit {
        return Err(FilesError::TooLarge { path: path.to_owned(), len: bytes.len() as u64, limit });
    }
    String::from_utf8(bytes).map_err(|e| FilesError::Io {
        path: path.to_owned(),
        error: std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("not UTF-8 text (at byte {})", e.utf8_error().valid_up_to()),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_regular_files_are_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let err = open_regular(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is a directory") && err.contains(&dir.path().display().to_string()), "{err}");
        #[cfg(unix)]
        {
            let fifo = dir.path().join("pipe");
            let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            let err = open_regular(&fifo).unwrap_err().to_string();
            assert!(err.contains("FIFO") && err.contains("pipe"), "{err}");
            let err = read_text(Path::new("/dev/zero"), 1024).unwrap_err().to_string();
            assert!(err.contains("character device") && err.contains("/dev/zero"), "{err}");
        }
    }

    #[test]
    fn text_over_the_cap_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.toml");
        std::fs::write(&p, vec![b'a'; 2000]).unwrap();
        let err = read_text(&p, 1000).unwrap_err().to_string();
        assert!(err.contains("big.toml") && err.contains("2000") && err.contains("1000"), "{err}");
        assert_eq!(read_text(&p, 2000).unwrap().len(), 2000);
    }
}

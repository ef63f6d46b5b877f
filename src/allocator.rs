//! The allocator's two thresholds, set once at the start of the process (glibc only).
//!
//! glibc's `malloc` serves a block of 128 KiB or more with its own `mmap`, but raises that
//! threshold to the size of any such block freed (up to 32 MiB): after the first large buffer
//! (a batch's parameters, a statement's bind message, a frame of the broker link) every later
//! one comes from the heap, where freed space is kept and fragments, and a heap's top is
//! returned to the system only above 128 KiB free. Both fixed lower (blocks of 64 KiB or more
//! mapped and unmapped on their own, a heap's free top returned above 128 KiB) take peak RSS on
//! `compare.sh` from about 13 to 10 MiB of anonymous memory, at no measured cost in rate or CPU
//! (docs/performance.md, "Memory"). An operator who tunes malloc through the environment
//! (`GLIBC_TUNABLES` naming `glibc.malloc.*`, `MALLOC_MMAP_THRESHOLD_`, `MALLOC_TRIM_THRESHOLD_`)
//! keeps their values.

/// Blocks of this size or more are mapped on their own, and unmapped when freed.
const MMAP_THRESHOLD: i32 = 64 * 1024;

/// A heap's free top above this size is returned to the system.
const TRIM_THRESHOLD: i32 = 128 * 1024;

/// Sets the thresholds, unless the environment tunes malloc; call before any thread starts.
pub fn tune() {
    let tuned = std::env::var("GLIBC_TUNABLES").is_ok_and(|t| t.contains("glibc.malloc."))
        || std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_some()
        || std::env::var_os("MALLOC_TRIM_THRESHOLD_").is_some();
    if !tuned {
        set();
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() {
    // SAFETY: mallopt only changes the allocator's parameters; it is called before any other
    // thread exists (the first line of `main`), and a refused value (it returns 0) leaves
    // glibc's default in place.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() {}

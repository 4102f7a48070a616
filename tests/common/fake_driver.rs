//! The fake CUDA driver's test hooks (`tests/fake_cuda/libcuda.c`), found
//! with dlopen/dlsym in the driver library cudarc loaded. Each is
//! `int fakeCudaX(int)` and only reads or sets the fake's own counters and
//! flags; a real driver has none of them. `scripts/fake-cuda.sh` sets
//! `DEVICE_EVENTS_FAKE_CUDA=1`, and there a missing hook fails the test
//! instead of skipping its checks.
// FFI (dlopen, dlsym, the hooks), each unsafe block with a SAFETY note.
#![allow(unsafe_code)]

use std::ffi::{c_int, CStr};

type Hook = unsafe extern "C" fn(c_int) -> c_int;

/// Whether the tests run on the fake driver (`DEVICE_EVENTS_FAKE_CUDA=1`).
pub fn is_fake() -> bool {
    std::env::var("DEVICE_EVENTS_FAKE_CUDA").is_ok_and(|fake| fake == "1")
}

/// The fake driver's hook `name`, or `None`: a real driver, or no driver
/// loaded yet.
fn lookup(name: &CStr) -> Option<Hook> {
    // Only the fake's hooks: a real driver exports no `fakeCuda*` symbol, so
    // one found by that name is a hook (see the transmute below).
    assert!(
        name.to_bytes().starts_with(b"fakeCuda"),
        "{name:?} is not a hook of the fake driver"
    );
    // SAFETY: the arguments are a NUL-terminated literal and valid flags.
    // With RTLD_NOLOAD dlopen loads nothing (so runs no initialiser): it only
    // finds the library cudarc already loaded, or returns null. The handle
    // is never closed, so the library, and any symbol found in it, stays
    // loaded for the rest of the process.
    let library =
        unsafe { libc::dlopen(c"libcuda.so".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if library.is_null() {
        return None;
    }
    // SAFETY: `library` is a live handle (non-null, never closed) and `name`
    // is NUL-terminated (a `CStr`).
    let symbol = unsafe { libc::dlsym(library, name.as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: `symbol` is non-null and names a `fakeCuda*` function (checked
    // above); the fake defines every one as `int fakeCudaX(int)`, which is
    // `Hook` in the C ABI.
    Some(unsafe { std::mem::transmute::<*mut libc::c_void, Hook>(symbol) })
}

/// The fake driver's hook `name` (a `fakeCuda*` function) called with
/// `arg`: its answer, or `None` on a real driver.
///
/// # Panics
///
/// When `DEVICE_EVENTS_FAKE_CUDA=1` and the hook is not found (the fake
/// lacks it, or the CUDA backend was not used yet): a check on the fake
/// driver must not silently skip.
pub fn call(name: &CStr, arg: c_int) -> Option<c_int> {
    let Some(hook) = lookup(name) else {
        assert!(
            !is_fake(),
            "DEVICE_EVENTS_FAKE_CUDA=1 but the fake driver's hook {name:?} was not found \
             (is libcuda.so the fake, and was the CUDA backend used before this call?)"
        );
        return None;
    };
    // SAFETY: `hook` is the fake's `int fakeCudaX(int)` (see `lookup`): it
    // takes any int (range-checked or ignored) and only reads or sets the
    // fake's own counters and flags (under its lock, atomic or
    // thread-local), touching no memory of the caller's.
    Some(unsafe { hook(arg) })
}

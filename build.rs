//! Sets `cfg(multi_threading)` on targets that have threads, as the seed has
//! it: the drop queue and the waiter need them, the fence itself does not.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(multi_threading)");
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let threadless = arch == "wasm32" && os != "wasi" || os == "none";
    if !threadless {
        println!("cargo::rustc-cfg=multi_threading");
    }
}

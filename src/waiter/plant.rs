//! Planted defects: each one a bug that a review once found (or that a fix
//! removed), switched on by name so that `scripts/plant-defects.sh` can check
//! that a loom model fails with it.
//!
//! The hooks exist only in builds with `--cfg device_events_plant`; there,
//! `DEVICE_EVENTS_PLANT=<name>` picks the defect for the whole process. In
//! every other build [`planted`] is a constant `false` and the defect's code
//! is compiled out. A hook sits beside the code it breaks, so a refactor that
//! moves the code moves the plant with it.

/// Whether the defect `name` is planted in this process.
#[cfg(device_events_plant)]
pub(crate) fn planted(name: &str) -> bool {
    static PLANT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PLANT.get_or_init(|| std::env::var("DEVICE_EVENTS_PLANT").unwrap_or_default()) == name
}

/// Whether the defect `name` is planted: never, outside plant builds.
#[cfg(not(device_events_plant))]
#[inline(always)]
pub(crate) const fn planted(_name: &str) -> bool {
    false
}

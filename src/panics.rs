//! Panics in code the crate calls but does not own (launched work, a task's waker, a value's
//! drop, a user's fence), caught where the call is made.
//!
//! A panic's payload is user data too, whose drop may panic: it is dropped under `catch_unwind`
//! as well, and a second payload is leaked rather than risk a third.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Run `call`; a panic comes back as its message (when a string), its payload dropped.
pub(crate) fn catch<T>(call: impl FnOnce() -> T) -> Result<T, String> {
    catch_unwind(AssertUnwindSafe(call)).map_err(|payload| {
        let message = match (
            payload.downcast_ref::<&str>(),
            payload.downcast_ref::<String>(),
        ) {
            (Some(message), _) => (*message).to_owned(),
            (_, Some(message)) => message.clone(),
            _ => "a panic with a non-string payload".to_owned(),
        };
        if let Err(again) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
            std::mem::forget(again);
        }
        message
    })
}

/// Drop `value`; a panic in its drop comes back as its message.
pub(crate) fn drop_caught<T>(value: T) -> Result<(), String> {
    catch(move || drop(value))
}

/// Log through the application's logger, which is not ours either: one that panics loses the
/// line, nothing else.
pub(crate) fn log(line: impl FnOnce()) {
    let _ = catch(line);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A payload whose own drop panics.
    struct Bomb;

    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("the payload's drop");
        }
    }

    /// A payload whose drop panics with a [`Bomb`]: the second payload.
    struct Nested;

    impl Drop for Nested {
        fn drop(&mut self) {
            std::panic::panic_any(Bomb);
        }
    }

    /// A payload whose drop panics is caught, and a second payload (which would panic a third
    /// time) is leaked, not dropped.
    #[test]
    fn a_payload_whose_drop_panics_goes_no_further() {
        let message = Err("a panic with a non-string payload".to_owned());
        assert_eq!(catch(|| std::panic::panic_any(Bomb)), message);
        assert_eq!(catch(|| std::panic::panic_any(Nested)), message);
    }

    #[test]
    fn a_drop_that_panics_is_its_message() {
        struct Loud;
        impl Drop for Loud {
            fn drop(&mut self) {
                panic!("loud");
            }
        }
        assert_eq!(drop_caught(Loud), Err("loud".to_owned()));
        assert_eq!(catch(|| 7), Ok(7));
    }

    /// A logger that panics loses its line: the panic goes no further.
    #[test]
    fn a_logger_that_panics_loses_only_its_line() {
        let ran = std::cell::Cell::new(false);
        log(|| {
            ran.set(true);
            panic!("a logger that panics");
        });
        assert!(ran.get(), "the line was logged");
    }
}

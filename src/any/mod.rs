//! A fence, a stream and a profiler of either backend, chosen at run time: for code that
//! serves a GPU when there is one and CPU host streams when there is not.
//!
//! - `fence.rs`: [`AnyFence`] and its future;
//! - `stream.rs`: [`AnyStream`], which makes them;
//! - `profiler.rs`: [`AnyProfiler`], an [`EventProfiler`](crate::EventProfiler) per backend.

/// `Debug` of `Any*` enums (`$inner`) of each backend's value, or of wrappers of one (its field
/// `.0`): that value's.
#[cfg(multi_threading)]
macro_rules! any_debug {
    ($($any:ident$(.$field:tt)?($inner:ident)),+) => {$(
        impl std::fmt::Debug for $any {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                match_backend!(&self$(.$field)?, $inner(inner) => inner.fmt(f))
            }
        }
    )+};
}

/// `Awaitable` (on the waiter) and `IntoFuture` (its `wait()`) for `$awaitable`, whose enum of
/// each backend's value is `$enum` (itself, or its field `.0`); `Future`, `FusedFuture` and
/// `Debug` for `$future`, a wrapper of an enum (`$inner`) of each backend's future: that future's.
#[cfg(multi_threading)]
macro_rules! any_future {
    ($awaitable:ident$(.$field:tt)?($enum:ident) => $future:ident($inner:ident) -> $output:ty) => {
        impl crate::waiter::sealed::Sealed for $awaitable {}

        impl crate::waiter::Awaitable for $awaitable {
            type Future = $future;

            fn wait_on(self, waiter: &crate::Waiter) -> $future {
                $future(match self$(.$field)? {
                    #[cfg(feature = "cuda")]
                    $enum::Cuda(value) => $inner::Cuda(waiter.wait(value)),
                    $enum::Host(value) => $inner::Host(waiter.wait(value)),
                })
            }
        }

        impl std::future::IntoFuture for $awaitable {
            type Output = $output;
            type IntoFuture = $future;

            fn into_future(self) -> $future {
                self.wait()
            }
        }

        impl std::future::Future for $future {
            type Output = $output;

            fn poll(
                self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<$output> {
                let inner = &mut self.get_mut().0;
                match_backend!(inner, $inner(future) => std::pin::Pin::new(future).poll(cx))
            }
        }

        impl futures::future::FusedFuture for $future {
            fn is_terminated(&self) -> bool {
                match_backend!(&self.0, $inner(future) => future.is_terminated())
            }
        }

        any_debug!($future.0($inner));
    };
}

#[cfg(multi_threading)]
mod fence;
#[cfg(multi_threading)]
mod profiler;
mod stream;

#[cfg(multi_threading)]
pub use fence::{AnyFence, AnyFenceFuture};
#[cfg(multi_threading)]
pub use profiler::{AnyProfile, AnyProfileFuture, AnyProfileStart, AnyProfiler};
pub use stream::AnyStream;

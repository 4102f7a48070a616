//! The HTTP service example (`examples/http_service.rs`), started in-process
//! on a loopback port and driven over HTTP/1.1: good jobs, each kind of bad
//! input, a faulted stream, timeouts and `/metrics`, and shutdown with a
//! request in flight.

#[path = "../examples/http_service.rs"]
#[allow(dead_code, unreachable_pub)]
mod http_service;

mod common;

use std::sync::Arc;
use std::time::Duration;

use device_events::drop_queue::Rejected;
use http_service::{AppState, WaitBy};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;

/// One request on its own connection; the status and the JSON body.
async fn request(
    address: std::net::SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, Value) {
    let mut connection = TcpStream::connect(address).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    connection
        .write_all(request.as_bytes())
        .await
        .expect("send");
    let mut response = Vec::new();
    connection.read_to_end(&mut response).await.expect("read");
    let response = String::from_utf8(response).expect("UTF-8");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {response:?}"));
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let json = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, json)
}

struct Service {
    address: std::net::SocketAddr,
    state: Arc<AppState>,
    stop: Option<oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(wait_by: WaitBy) -> Service {
    start_with(AppState::host(2, wait_by).expect("host streams")).await
}

async fn start_with(state: AppState) -> Service {
    let state = Arc::new(state);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = oneshot::channel::<()>();
    let served = tokio::spawn(http_service::serve(listener, state.clone(), async move {
        let _ = stopped.await;
    }));
    Service {
        address,
        state,
        stop: Some(stop),
        served,
    }
}

/// A job of `work_us` answered: its device time at least the work's
/// length, and the request's time its device time and the rest.
fn check_times(body: &Value, work_us: u64) {
    let device = body["device_us"].as_u64().unwrap();
    let queued = body["queued_us"].as_u64().unwrap();
    let total = body["total_us"].as_u64().unwrap();
    assert!(device >= work_us, "{body}");
    assert_eq!(device + queued, total, "{body}");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn good_jobs_are_answered_by_await_and_by_spawn_blocking() {
    runtime().block_on(async {
        for wait_by in [WaitBy::Await, WaitBy::SpawnBlocking] {
            let service = start(wait_by).await;
            let (status, body) = request(
                service.address,
                "POST",
                "/jobs",
                r#"{"work_us": 2000, "stream": 1}"#,
            )
            .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["stream"], 1);
            assert_eq!(body["backend"], "Host");
            check_times(&body, 2000);
            let (status, body) = request(
                service.address,
                "POST",
                "/jobs",
                r#"{"work_us": 0, "stream": "any"}"#,
            )
            .await;
            assert_eq!(status, 200, "{body}");
            let (status, stats) = request(service.address, "GET", "/stats", "").await;
            assert_eq!(status, 200, "{stats}");
            assert_eq!(stats["waiter"]["pending"], 0);
            assert!(stats["process_threads"].as_u64().unwrap() > 0, "{stats}");
            // Two jobs, each timed with a start and a stop event; the
            // second job's stream may be either, so two or four events.
            let created = stats["profiler"]["created"].as_u64().unwrap();
            assert!(created == 2 || created == 4, "{stats}");
            assert_eq!(stats["wait_by"], format!("{wait_by:?}"));
        }
    });
}

#[test]
fn bad_input_gets_a_4xx_with_the_reason() {
    runtime().block_on(async {
        let service = start(WaitBy::Await).await;
        let cases = [
            (r#"{"work_us": 10, "stream": 7}"#, "unknown stream"),
            (r#"{"work_us": 10, "stream": "fastest"}"#, "unknown stream"),
            (r#"{"work_us": -5}"#, "must not be negative"),
            (r#"{"work_us": 99999999999}"#, "more than the most"),
            (r#"{"work_us": 1.5}"#, "whole number"),
            (r#"{"stream": 0}"#, "missing \"work_us\""),
            (r#"{"work_us": 10, "fault": "yes"}"#, "\"fault\" must be"),
            (
                r#"{"work_us": 10, "timeout_ms": -1}"#,
                "\"timeout_ms\" must be",
            ),
            (r#"{"work_us": 10"#, "malformed JSON"),
            ("not json at all", "malformed JSON"),
        ];
        for (body, reason) in cases {
            let (status, answer) = request(service.address, "POST", "/jobs", body).await;
            assert_eq!(status, 400, "{body} -> {answer}");
            let message = answer["error"].as_str().unwrap_or_default();
            assert!(
                message.contains(reason),
                "{body} -> {message:?}, wanted {reason:?}"
            );
        }
        // Still serving.
        let (status, _) = request(service.address, "POST", "/jobs", r#"{"work_us": 1}"#).await;
        assert_eq!(status, 200);
    });
}

#[test]
fn a_faulted_stream_answers_500_and_the_others_go_on() {
    runtime().block_on(async {
        let service = start(WaitBy::Await).await;
        let (status, body) = request(
            service.address,
            "POST",
            "/jobs",
            r#"{"work_us": 10, "stream": 0, "fault": true}"#,
        )
        .await;
        assert_eq!(status, 500, "{body}");
        assert!(
            body["error"].as_str().unwrap().contains("faulted"),
            "{body}"
        );
        // Stream 0 stays faulted; stream 1 serves.
        let (status, body) = request(
            service.address,
            "POST",
            "/jobs",
            r#"{"work_us": 10, "stream": 0}"#,
        )
        .await;
        assert_eq!(status, 500, "{body}");
        let (status, body) = request(
            service.address,
            "POST",
            "/jobs",
            r#"{"work_us": 10, "stream": 1}"#,
        )
        .await;
        assert_eq!(status, 200, "{body}");
    });
}

#[test]
fn shutdown_lets_a_request_in_flight_finish_then_stops_the_waiter() {
    runtime().block_on(async {
        let mut service = start(WaitBy::Await).await;
        let address = service.address;
        let in_flight = tokio::spawn(async move {
            request(
                address,
                "POST",
                "/jobs",
                r#"{"work_us": 300000, "stream": 0}"#,
            )
            .await
        });
        // Shut down once the job's wait is with the waiter: in flight.
        let handed_off = async {
            while service.state.waiter.pending() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(20), handed_off)
            .await
            .expect("the job's wait reaches the waiter");
        service.stop.take().unwrap().send(()).unwrap();
        let (status, body) = in_flight.await.unwrap();
        assert_eq!(status, 200, "{body}");
        service.served.await.unwrap().unwrap();
        assert_eq!(service.state.waiter.pending(), 0);
        // The waiter was shut down with the service: a wait that needs it
        // (its stream is held) is refused.
        let late = device_events::host::HostStream::new().unwrap();
        let (open, opened) = std::sync::mpsc::channel::<()>();
        late.launch(move || {
            let _ = opened.recv();
        })
        .unwrap();
        let gone = service.state.waiter.wait(late.fence()).await;
        assert_eq!(gone, Err(device_events::ServerError::WaiterGone));
        // So was each stream's staging queue: closed, it hands a buffer
        // back rather than keep it.
        for on in &service.state.streams {
            let refused = on.staging.push(late.fence().into(), Default::default());
            assert!(matches!(refused, Err(Rejected::Closed(..))), "{refused:?}");
        }
        drop(open);
        // The listener is gone: nothing answers any more.
        let refused = TcpStream::connect(address).await;
        assert!(refused.is_err(), "still accepting after shutdown");
    });
}

/// The same service on CUDA streams (the fake driver in
/// `scripts/fake-cuda.sh`, or a GPU): only the launch differs.
#[cfg(feature = "cuda")]
#[test]
fn the_same_service_runs_on_cuda_streams() {
    let state = match AppState::cuda(2, WaitBy::Await) {
        Ok(state) => state,
        Err(err) if std::env::var("DEVICE_EVENTS_REQUIRE_CUDA").is_ok_and(|value| value == "1") => {
            panic!("DEVICE_EVENTS_REQUIRE_CUDA=1 but no usable GPU: {err}")
        }
        Err(err) => {
            common::skipped::skip(
                "the_same_service_runs_on_cuda_streams",
                format!(
                    "no CUDA GPU here ({err}); set DEVICE_EVENTS_REQUIRE_CUDA=1 to fail instead"
                ),
            );
            return;
        }
    };
    runtime().block_on(async {
        let mut service = start_with(state).await;
        for stream in [0, 1] {
            let (status, body) = request(
                service.address,
                "POST",
                "/jobs",
                &format!(r#"{{"work_us": 2000, "stream": {stream}}}"#),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            assert_eq!(body["backend"], "Cuda");
            assert_eq!(body["stream"], stream);
            check_times(&body, 2000);
        }
        // A fault would take every stream of the device with it: refused.
        let (status, body) = request(
            service.address,
            "POST",
            "/jobs",
            r#"{"work_us": 10, "fault": true}"#,
        )
        .await;
        assert_eq!(status, 400, "{body}");
        let (status, stats) = request(service.address, "GET", "/stats", "").await;
        assert_eq!(status, 200, "{stats}");
        assert_eq!(stats["backend"], "Cuda");
        assert_eq!(stats["waiter"]["pending"], 0);
        service.stop.take().unwrap().send(()).unwrap();
        service.served.await.unwrap().unwrap();
    });
}

/// The sum of the samples of `name` in `/metrics` text whose labels include
/// `labels` (all the streams' drop queues, say); panics if there are none.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let values: Vec<f64> = text
        .lines()
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = series.split_once('{').unwrap_or((series, ""));
            let has = |&(key, value): &(&str, &str)| {
                series_labels.contains(&format!("{key}=\"{value}\""))
            };
            (series_name == name && labels.iter().all(has))
                .then(|| value.parse().expect("a number"))
        })
        .collect();
    assert!(!values.is_empty(), "no {name}{labels:?} in:\n{text}");
    values.iter().sum()
}

/// `GET /metrics`: the text and its status.
async fn metrics_text(address: std::net::SocketAddr) -> String {
    let mut connection = TcpStream::connect(address).await.expect("connect");
    connection
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: test\r\nconnection: close\r\n\r\n")
        .await
        .expect("send");
    let mut response = String::new();
    connection
        .read_to_string(&mut response)
        .await
        .expect("read");
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    assert!(response.contains("text/plain; version=0.0.4"), "{response}");
    response.split("\r\n\r\n").nth(1).unwrap().to_owned()
}

/// Every series the service publishes, each with its type: what today's
/// `/metrics` tells (see the CHANGELOG for the names they replace).
const SERIES: [(&str, &str); 16] = [
    ("device_events_waiter_threads", "gauge"),
    ("device_events_waiter_peak_threads", "gauge"),
    ("device_events_waiter_pending", "gauge"),
    ("device_events_waiter_cancelled_held", "gauge"),
    ("device_events_waiter_stuck_streams", "gauge"),
    ("device_events_waiter_handed_off_total", "counter"),
    ("device_events_waiter_awaits_total", "counter"),
    ("device_events_waiter_watched_total", "counter"),
    ("device_events_waiter_watcher_cpu_seconds", "gauge"),
    ("device_events_waiter_wake_latency_seconds", "histogram"),
    ("device_events_drop_queue_pushed_total", "counter"),
    ("device_events_drop_queue_settled_total", "counter"),
    ("device_events_drop_queue_pending", "gauge"),
    ("device_events_drop_queue_queued", "gauge"),
    ("device_events_profiler_events_created_total", "counter"),
    ("device_events_profiler_events_pooled", "gauge"),
];

#[test]
fn metrics_move_as_requests_are_served_and_cancelled() {
    runtime().block_on(async {
        let service = start(WaitBy::Await).await;
        let before = metrics_text(service.address).await;
        for (name, kind) in SERIES {
            assert!(
                before.contains(&format!("# TYPE {name} {kind}\n")),
                "no {kind} {name} in:\n{before}"
            );
        }
        let awaits = "device_events_waiter_awaits_total";
        let outcome = |outcome| [("waiter", "http-waiter"), ("outcome", outcome)];
        assert_eq!(metric(&before, awaits, &outcome("resolved")), 0.0);
        assert_eq!(metric(&before, awaits, &outcome("cancelled")), 0.0);
        for name in [
            "device_events_waiter_handed_off_total",
            "device_events_drop_queue_pushed_total",
        ] {
            assert_eq!(metric(&before, name, &[]), 0.0, "{name}");
        }
        // Three jobs, each answered; 200 ms of work, so mostly handed off (one
        // whose handler stalled as long finds its fence ready instead).
        for _ in 0..3 {
            let (status, body) = request(
                service.address,
                "POST",
                "/jobs",
                r#"{"work_us": 200000, "stream": 0}"#,
            )
            .await;
            assert_eq!(status, 200, "{body}");
        }
        // One given up on at its timeout: its wait is cancelled.
        let (status, body) = request(
            service.address,
            "POST",
            "/jobs",
            r#"{"work_us": 300000, "stream": 1, "timeout_ms": 20}"#,
        )
        .await;
        assert_eq!(status, 504, "{body}");
        let after = metrics_text(service.address).await;
        let moved =
            |name: &str, labels: &[_]| metric(&after, name, labels) - metric(&before, name, labels);
        // The staging buffer's fence is another wait, on its stream's drop
        // queue's own thread, not the service's waiter.
        let pushed = "device_events_drop_queue_pushed_total";
        assert_eq!(moved(pushed, &[]), 4.0);
        assert_eq!(moved(pushed, &[("stream", "0")]), 3.0);
        assert_eq!(moved(pushed, &[("stream", "1")]), 1.0);
        assert_eq!(moved(awaits, &outcome("cancelled")), 1.0, "{after}");
        let resolved = moved(awaits, &outcome("resolved"));
        let handed_off = moved("device_events_waiter_handed_off_total", &[]);
        let ready = moved(awaits, &outcome("ready_at_first_poll"));
        // Each served job awaited its fence and then its profile (each ready
        // at its first poll, or handed off and resolved).
        assert!(resolved >= 1.0, "{after}");
        assert_eq!(handed_off, resolved + 1.0, "the cancelled one: {after}");
        assert_eq!(ready + handed_off, 3.0 * 2.0 + 1.0, "{after}");
        let latency = "device_events_waiter_wake_latency_seconds";
        assert_eq!(metric(&after, &format!("{latency}_count"), &[]), resolved);
        let all = [("le", "+Inf")];
        assert_eq!(metric(&after, &format!("{latency}_bucket"), &all), resolved);
        assert_eq!(metric(&after, awaits, &outcome("failed")), 0.0);
        assert_eq!(
            metric(&after, "device_events_waiter_stuck_streams", &[]),
            0.0
        );
        // Every stream's queue and every context's profiler, by label.
        for stream in ["0", "1"] {
            let labels = [("backend", "Host"), ("stream", stream)];
            metric(&after, "device_events_drop_queue_pending", &labels);
            let labels = [("backend", "Host"), ("device", stream)];
            metric(&after, "device_events_profiler_events_pooled", &labels);
        }
        assert_eq!(
            metric(&after, "device_events_profiler_events_created_total", &[]),
            4.0 // two contexts used, a start and a stop event each
        );
    });
}

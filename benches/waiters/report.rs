//! Tables on stdout, the same as JSON, and latency plots as SVG, under
//! `target/bench-results/`.

use std::fmt::Write as _;
use std::path::PathBuf;

/// The scenarios, by number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    SingleWait,
    ManyPending,
    ManyPendingLarge,
    ReadyFence,
    FenceCost,
    IdleCpu,
    BusyWorkers,
    OneTaskPerStream,
    ReadyScaling,
    Streaming10Us,
    Streaming100Us,
    Streaming1Ms,
    StreamingLongThenShort,
    StreamingVaried,
}

impl Scenario {
    /// Its number, as `--only` takes it.
    pub fn id(self) -> &'static str {
        match self {
            Self::SingleWait => "1",
            Self::ManyPending => "2",
            Self::ManyPendingLarge => "2b",
            Self::ReadyFence => "3",
            Self::FenceCost => "4",
            Self::IdleCpu => "5",
            Self::BusyWorkers => "6",
            Self::OneTaskPerStream => "6b",
            Self::ReadyScaling => "7",
            Self::Streaming10Us => "8a",
            Self::Streaming100Us => "8b",
            Self::Streaming1Ms => "8c",
            Self::StreamingLongThenShort => "8d",
            Self::StreamingVaried => "8e",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Self::SingleWait => "single wait latency",
            Self::ManyPending => "many pending",
            Self::ManyPendingLarge => "many pending (large)",
            Self::ReadyFence => "ready fence",
            Self::FenceCost => "fence cost",
            Self::IdleCpu => "idle CPU",
            Self::BusyWorkers => "busy workers",
            Self::OneTaskPerStream => "one task per stream",
            Self::ReadyScaling => "ready scaling",
            Self::Streaming10Us => "streaming completions, 10 us items",
            Self::Streaming100Us => "streaming completions, 100 us items",
            Self::Streaming1Ms => "streaming completions, 1 ms items",
            Self::StreamingLongThenShort => "streaming completions, long items then 1 ms items",
            Self::StreamingVaried => "streaming completions, items of 0.5 to 4 ms",
        }
    }
}

/// A column of a table: typed, so a renamed column cannot silently turn a
/// target into "not measured".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    P50Us,
    P99Us,
    MeanUs,
    AllResolvedMs,
    PeakThreads,
    CpuMs,
    NsPerOp,
    NsPerFence,
    CpuPercentOfCore,
    Threads,
    AwaitsPerSecond,
    CpuUsPerAwait,
    ProcessCpuUsPerAwait,
    WatcherCpuUsPerAwait,
}

impl Metric {
    pub fn label(self) -> &'static str {
        match self {
            Self::P50Us => "p50 us",
            Self::P99Us => "p99 us",
            Self::MeanUs => "mean us",
            Self::AllResolvedMs => "all resolved ms",
            Self::PeakThreads => "peak threads",
            Self::CpuMs => "CPU ms",
            Self::NsPerOp => "ns per op",
            Self::NsPerFence => "ns per fence",
            Self::CpuPercentOfCore => "CPU % of a core",
            Self::Threads => "threads",
            Self::AwaitsPerSecond => "awaits/s",
            Self::CpuUsPerAwait => "CPU us per await",
            Self::ProcessCpuUsPerAwait => "process CPU us per await",
            Self::WatcherCpuUsPerAwait => "watcher CPU us per await",
        }
    }
}

/// One scenario on one backend: a row per strategy, the first row (this
/// crate) the reference for the ratios.
pub struct Table {
    pub scenario: Scenario,
    pub backend: &'static str,
    pub metrics: Vec<Metric>,
    pub rows: Vec<(String, Vec<f64>)>,
    pub notes: Vec<String>,
}

impl Table {
    pub fn new(scenario: Scenario, backend: &'static str, metrics: &[Metric]) -> Self {
        Self {
            scenario,
            backend,
            metrics: metrics.to_vec(),
            rows: Vec::new(),
            notes: Vec::new(),
        }
    }

    pub fn row(&mut self, name: &str, values: Vec<f64>) {
        assert_eq!(
            values.len(),
            self.metrics.len(),
            "row {name:?} of scenario {}: one value per metric",
            self.scenario.id()
        );
        self.rows.push((name.to_owned(), values));
    }

    /// The value of `metric` in row `name`; `None` when that row did not
    /// run.
    ///
    /// # Panics
    ///
    /// If the table has no such metric: a target that reads a column its
    /// scenario does not report is a bug in the benchmark, not a miss.
    pub fn value(&self, name: &str, metric: Metric) -> Option<f64> {
        let Some(column) = self.metrics.iter().position(|m| *m == metric) else {
            panic!(
                "scenario {} ({}) has no metric {:?}",
                self.scenario.id(),
                self.scenario.title(),
                metric
            )
        };
        let row = self.rows.iter().find(|(row, _)| row == name)?;
        row.1.get(column).copied()
    }

    pub fn print(&self) {
        println!(
            "\n## {}. {} [{}]",
            self.scenario.id(),
            self.scenario.title(),
            self.backend
        );
        let mut header = format!("| {:<26} |", "strategy");
        for metric in &self.metrics {
            let _ = write!(header, " {:>24} |", metric.label());
        }
        println!("{header}");
        println!("|{}", "---|".repeat(self.metrics.len() + 1));
        let reference = self.rows.first().map(|(_, values)| values.clone());
        for (name, values) in &self.rows {
            let mut line = format!("| {name:<26} |");
            for (column, value) in values.iter().enumerate() {
                // A figure a row does not have (NaN, printed '-') has no
                // ratio either.
                let ratio = reference
                    .as_ref()
                    .filter(|_| value.is_finite())
                    .and_then(|reference| reference.get(column))
                    .filter(|reference| **reference > 0.0)
                    .map(|reference| value / reference);
                let cell = match ratio {
                    Some(ratio) => format!("{} ({ratio:.2}x)", number(*value)),
                    None => number(*value),
                };
                let _ = write!(line, " {cell:>24} |");
            }
            println!("{line}");
        }
        for note in &self.notes {
            println!("  note: {note}");
        }
    }

    fn json(&self) -> String {
        let mut json = format!(
            "{{\"scenario\":{},\"backend\":{},\"rows\":[",
            quote(&format!(
                "{}. {}",
                self.scenario.id(),
                self.scenario.title()
            )),
            quote(self.backend)
        );
        for (i, (name, values)) in self.rows.iter().enumerate() {
            if i > 0 {
                json.push(',');
            }
            let _ = write!(json, "{{\"strategy\":{}", quote(name));
            for (metric, value) in self.metrics.iter().zip(values) {
                let _ = write!(json, ",{}:{}", quote(metric.label()), json_number(*value));
            }
            json.push('}');
        }
        json.push_str("],\"notes\":[");
        let notes: Vec<String> = self.notes.iter().map(|note| quote(note)).collect();
        json.push_str(&notes.join(","));
        json.push_str("]}");
        json
    }
}

fn number(value: f64) -> String {
    if !value.is_finite() {
        "-".to_owned()
    } else if value.abs() >= 100.0 {
        format!("{value:.0}")
    } else if value.abs() >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn json_number(value: f64) -> String {
    if value.is_finite() {
        format!("{value}")
    } else {
        "null".to_owned()
    }
}

fn quote(text: &str) -> String {
    let mut quoted = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(quoted, "\\u{:04x}", c as u32);
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// Where results go: `$CARGO_TARGET_DIR` or `target/`, then `bench-results/`.
pub fn results_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("bench-results");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

pub fn write_json(name: &str, tables: &[Table], summary: &[String]) -> PathBuf {
    let tables: Vec<String> = tables.iter().map(Table::json).collect();
    let summary: Vec<String> = summary.iter().map(|line| quote(line)).collect();
    let json = format!(
        "{{\"tables\":[{}],\"summary\":[{}]}}\n",
        tables.join(","),
        summary.join(",")
    );
    let path = results_dir().join(name);
    if let Err(err) = std::fs::write(&path, json) {
        eprintln!("could not write {}: {err}", path.display());
    }
    path
}

/// A CDF of wake latencies per strategy, log-scaled, as an SVG file.
pub fn write_latency_svg(name: &str, title: &str, series: &[(String, Vec<u64>)]) -> PathBuf {
    const W: f64 = 760.0;
    const H: f64 = 420.0;
    const LEFT: f64 = 70.0;
    const RIGHT: f64 = 220.0;
    const TOP: f64 = 40.0;
    const BOTTOM: f64 = 50.0;
    const COLORS: [&str; 6] = [
        "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#7f7f7f", "#ff7f0e",
    ];
    let micros = |nanos: u64| (nanos as f64 / 1_000.0).max(0.1);
    let all = series.iter().flat_map(|(_, values)| values.iter().copied());
    let max = all.clone().map(micros).fold(1.0f64, f64::max);
    let min = all.map(micros).fold(max, f64::min).min(1.0);
    let (lo, hi) = (
        min.log10().floor(),
        max.log10().ceil().max(min.log10().floor() + 1.0),
    );
    let x = |us: f64| LEFT + (us.log10() - lo) / (hi - lo) * (W - LEFT - RIGHT);
    let y = |q: f64| TOP + (1.0 - q) * (H - TOP - BOTTOM);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{LEFT}\" y=\"22\" font-size=\"15\">{}</text>\n",
        escape(title)
    );
    let (x0, x1, y0, y1) = (x(10f64.powf(lo)), x(10f64.powf(hi)), y(0.0), y(1.0));
    let _ = writeln!(
        svg,
        "<rect x=\"{x0}\" y=\"{y1}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#444\"/>",
        x1 - x0,
        y0 - y1
    );
    let mut decade = lo;
    while decade <= hi {
        let px = x(10f64.powf(decade));
        let label = number(10f64.powf(decade));
        let _ = writeln!(svg, "<line x1=\"{px}\" y1=\"{y1}\" x2=\"{px}\" y2=\"{y0}\" stroke=\"#ddd\"/><text x=\"{px}\" y=\"{}\" text-anchor=\"middle\">{label} µs</text>", y0 + 18.0);
        decade += 1.0;
    }
    for q in [0.0, 0.5, 0.9, 0.99, 1.0] {
        let py = y(q);
        let _ = writeln!(svg, "<line x1=\"{x0}\" y1=\"{py}\" x2=\"{x1}\" y2=\"{py}\" stroke=\"#eee\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">p{}</text>", x0 - 6.0, py + 4.0, (q * 100.0).round());
    }
    let _ = writeln!(svg, "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">wake latency (work end to task running), log scale</text>", (x0 + x1) / 2.0, H - 8.0);
    for (i, (name, values)) in series.iter().enumerate() {
        if values.is_empty() {
            continue;
        }
        let color = COLORS[i % COLORS.len()];
        let step = (values.len() / 400).max(1);
        let points: Vec<String> = values
            .iter()
            .enumerate()
            .filter(|(k, _)| k % step == 0 || *k == values.len() - 1)
            .map(|(k, v)| {
                format!(
                    "{:.1},{:.1}",
                    x(micros(*v)),
                    y((k + 1) as f64 / values.len() as f64)
                )
            })
            .collect();
        let _ = writeln!(
            svg,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        let ly = TOP + 20.0 + i as f64 * 20.0;
        let _ = writeln!(svg, "<line x1=\"{}\" y1=\"{ly}\" x2=\"{}\" y2=\"{ly}\" stroke=\"{color}\" stroke-width=\"3\"/><text x=\"{}\" y=\"{}\">{}</text>", x1 + 12.0, x1 + 32.0, x1 + 38.0, ly + 4.0, escape(name));
    }
    svg.push_str("</svg>\n");
    let path = results_dir().join(name);
    if let Err(err) = std::fs::write(&path, svg) {
        eprintln!("could not write {}: {err}", path.display());
    }
    path
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

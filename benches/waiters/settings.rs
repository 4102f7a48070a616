//! The benchmark's settings: full, `--quick` or `--large`, `--only`, and the sample counts
//! (`--rounds`, `--reps`) for runs that must tell small differences from the machine's noise.

use std::time::Duration;

use crate::strategies::{self, Strategy};

pub struct Settings {
    pub quick: bool,
    pub large: bool,
    pub rounds: usize,
    pub warmup: usize,
    pub work: Duration,
    pub many: (usize, usize),
    pub hold: Duration,
    pub ready: usize,
    pub idle_waits: usize,
    pub idle_window: Duration,
    /// Repetitions of scenarios 2 and 8 (`--reps N`); each figure is the median over them.
    pub reps: usize,
    /// `--only 1,4`: run just these scenarios (by number; `2b` is `--large`;
    /// `8` is `8a` to `8e`).
    pub only: Option<Vec<String>>,
    /// `--strategies await,spawn_blocking`: in scenarios 1, 2, 2b and 8,
    /// run just these (by [`Strategy::flag`]), e.g. to profile one, or to
    /// time this crate's waiters with no other strategy's turns between
    /// theirs; in scenario 8, any of scenario 1's, not only its usual rows.
    /// Two floors run only when named, in scenario 1: `spin_hop` and
    /// `spin_race` ([`Strategy::SpinHop`], [`Strategy::SpinRace`]).
    pub strategies: Option<Vec<String>>,
}

const USAGE: &str =
    "usage: cargo bench --bench waiters -- [--quick] [--large] [--only 1,2,2b,3,4,5,6,6b,7,8,8a,8b,8c,8d,8e] \
     [--rounds N] [--reps N] [--strategies await,await_sleeping,await_watching,spawn_blocking,thread,query_yield,raw,raw_handoff,one_hop,spin_hop,spin_race]";

impl Settings {
    pub fn from_args() -> Self {
        let (mut quick, mut large, mut only, mut strategies) = (false, false, None, None);
        let (mut rounds, mut reps) = (None, None);
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--quick" => quick = true,
                "--large" => large = true,
                // cargo bench passes --bench to harness = false benchmarks.
                "--bench" => {}
                "--only" => match args.next() {
                    Some(list) => {
                        only = Some(list.split(',').map(str::to_owned).collect::<Vec<_>>())
                    }
                    None => usage_error("--only needs a list of scenarios"),
                },
                "--rounds" => rounds = Some(count(args.next(), "--rounds")),
                "--reps" => reps = Some(count(args.next(), "--reps")),
                "--strategies" => match args.next() {
                    Some(list) => {
                        let names: Vec<String> = list.split(',').map(str::to_owned).collect();
                        let known = strategies::nameable();
                        if let Some(unknown) = names
                            .iter()
                            .find(|name| !known.iter().any(|known| known.flag() == *name))
                        {
                            usage_error(&format!("unknown strategy {unknown:?}"));
                        }
                        strategies = Some(names);
                    }
                    None => usage_error("--strategies needs a list of strategies"),
                },
                other => usage_error(&format!("unknown argument {other:?}")),
            }
        }
        let settings = Self::for_mode(quick, large);
        Self {
            rounds: rounds.unwrap_or(settings.rounds),
            reps: reps.unwrap_or(settings.reps),
            only,
            strategies,
            ..settings
        }
    }

    /// Whether scenario `id` ("1", "2b", ...) runs.
    pub fn runs(&self, id: &str) -> bool {
        self.only
            .as_ref()
            .is_none_or(|only| only.iter().any(|wanted| wanted == id))
    }

    /// `usual` without `--strategies`; with it, those it names of `all`.
    pub fn pick_or(&self, usual: &[Strategy], all: &[Strategy]) -> Vec<Strategy> {
        match self.strategies {
            None => usual.to_vec(),
            Some(_) => self.pick(all),
        }
    }

    /// `all`, less the strategies `--strategies` leaves out.
    pub fn pick(&self, all: &[Strategy]) -> Vec<Strategy> {
        all.iter()
            .copied()
            .filter(|strategy| {
                self.strategies
                    .as_ref()
                    .is_none_or(|wanted| wanted.iter().any(|name| name == strategy.flag()))
            })
            .collect()
    }

    fn for_mode(quick: bool, large: bool) -> Self {
        if quick {
            Self {
                quick,
                large,
                rounds: 50,
                warmup: 5,
                work: Duration::from_micros(200),
                many: (4, 100),
                hold: Duration::from_millis(300),
                ready: 5_000,
                idle_waits: 100,
                idle_window: Duration::from_millis(200),
                reps: 1,
                only: None,
                strategies: None,
            }
        } else {
            Self {
                quick,
                large,
                rounds: 3_000,
                warmup: 50,
                work: Duration::from_micros(200),
                many: (16, 625),
                hold: Duration::from_millis(1_500),
                ready: 100_000,
                idle_waits: 1_000,
                idle_window: Duration::from_secs(1),
                reps: 5,
                only: None,
                strategies: None,
            }
        }
    }
}

/// The count given after `flag`: a whole number from 1.
fn count(value: Option<String>, flag: &str) -> usize {
    match value.as_deref().map(str::parse::<usize>) {
        Some(Ok(count)) if count > 0 => count,
        _ => usage_error(&format!("{flag} needs a count from 1")),
    }
}

fn usage_error(message: &str) -> ! {
    eprintln!("{message}\n{USAGE}");
    std::process::exit(2);
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

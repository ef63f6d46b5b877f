//! Metrics scraping: the `/metrics` text (`scrape_text`), parsed (`Scrape`, `Sample`), waited on
//! (`wait_scrape`), and single values (`metric`, `try_metric`).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::env::TestEnv;
use super::warren::Warren;

/// One sample line of the exposition format.
#[derive(Debug, Clone)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// A parsed scrape: its text, its samples, and the family types of its `# TYPE` lines.
#[derive(Debug, Clone)]
pub struct Scrape {
    /// The text as scraped.
    pub text: String,
    pub samples: Vec<Sample>,
    /// Family name -> type (`counter`, `gauge`, `histogram`...).
    pub types: BTreeMap<String, String>,
}

impl Scrape {
    /// Parses an exposition; panics on a line that is not a comment or a sample.
    pub fn parse(text: String) -> Self {
        let mut samples = Vec::new();
        let mut types = BTreeMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                    types.insert(name.to_string(), kind.to_string());
                }
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            samples.push(
                parse_sample(line).unwrap_or_else(|| panic!("unparsable metrics line {line:?}")),
            );
        }
        Scrape {
            text,
            samples,
            types,
        }
    }

    /// The samples of `name` whose labels include every `(label, value)` of `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The sum of the matching samples; 0 when there is none.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }

    /// The value of the one matching sample, if there is exactly one.
    pub fn one(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let found: Vec<f64> = self.matching(name, labels).map(|s| s.value).collect();
        (found.len() == 1).then(|| found[0])
    }

    /// Every distinct value of `label` among the samples of `name`.
    pub fn label_values(&self, name: &str, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter(|s| s.name == name)
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }
}

/// `name{a="x",b="y"} value [timestamp]`, with escaped label values.
fn parse_sample(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = line[..name_end].to_string();
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        let consumed = loop {
            // Skip separators, then read `key="value"` or the closing brace.
            while let Some((_, c)) = chars.peek() {
                if *c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let (i, c) = chars.next()?;
            if c == '}' {
                break i + 1;
            }
            let mut key = String::from(c);
            for (_, c) in chars.by_ref() {
                if c == '=' {
                    break;
                }
                key.push(c);
            }
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => break,
                    other => value.push(other),
                }
            }
            labels.insert(key.trim().to_string(), value);
        };
        rest = &inner[consumed..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// The text of the env's `/metrics`, or the error if nothing answers (yet).
pub async fn scrape_text(env: &TestEnv) -> Result<String, String> {
    let url = format!("http://127.0.0.1:{}/metrics", env.metrics_port);
    tokio::task::spawn_blocking(move || {
        ureq::get(&url)
            .call()
            .and_then(|mut r| r.body_mut().read_to_string())
            .map_err(|e| e.to_string())
    })
    .await
    .expect("metrics task")
}

/// The sum of the samples of `name` whose labels include every `(label, value)` of `labels`.
/// A series absent from an answering `/metrics` is 0 (a counter never incremented has no
/// series yet); a `/metrics` that does not answer panics: it is never read as 0. Use it for
/// "this never happened" (`metric(..) == 0.0`), never `try_metric(..).unwrap_or(0.0)`.
pub async fn metric(env: &TestEnv, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = scrape_text(env)
        .await
        .unwrap_or_else(|e| panic!("metrics endpoint: {e}"));
    Scrape::parse(text).sum(name, labels)
}

/// Like [`metric`], but `None` when no sample matches or the endpoint does not answer: for
/// polling (`wait_until(.., try_metric(..) == Some(1.0))`), never for a check that something
/// is 0 (`None` would pass it when nothing answers; use [`metric`]).
pub async fn try_metric(env: &TestEnv, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let scrape = Scrape::parse(scrape_text(env).await.ok()?);
    let values: Vec<f64> = scrape.matching(name, labels).map(|s| s.value).collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// `basic.ack` frames sent and batches inserted by the users stage (`main`) so far: about one
/// ack a batch on the happy path (multi-acks), far more when acks go one by one. Panics when
/// `/metrics` does not answer or either series is absent (a renamed metric read as 0 acks
/// would pass every `acks <= k * batches`).
pub async fn acks_and_batches(env: &TestEnv) -> (f64, f64) {
    let text = scrape_text(env)
        .await
        .unwrap_or_else(|e| panic!("metrics endpoint: {e}"));
    let scrape = Scrape::parse(text);
    let of = |name: &str| {
        let found: Vec<f64> = scrape
            .matching(name, &[("pipeline", "users"), ("stage", "main")])
            .map(|s| s.value)
            .collect();
        assert!(
            !found.is_empty(),
            "no {name}{{pipeline=\"users\",stage=\"main\"}} in /metrics:\n{}",
            scrape.text
        );
        found.iter().sum::<f64>()
    };
    (of("warren_amqp_acks_total"), of("warren_batch_size_count"))
}

/// Waits until `/metrics` answers and `condition` holds on its scrape; returns that scrape.
/// Panics after `timeout` with the last scrape and warren's log.
pub async fn wait_scrape(
    env: &TestEnv,
    warren: &Warren,
    what: &str,
    timeout: Duration,
    condition: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        if let Ok(text) = scrape_text(env).await {
            let s = Scrape::parse(text);
            if condition(&s) {
                return s;
            }
            last = s.text;
        }
        if Instant::now() > deadline {
            panic!(
                "timed out after {timeout:?} waiting for: {what}\nlast scrape:\n{last}\nlog:\n{}",
                warren.logs()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

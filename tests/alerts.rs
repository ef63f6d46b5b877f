//! The Prometheus alert rules (prometheus/warren-alerts.yml): promtool accepts them, their unit
//! tests (prometheus/tests/) pass and give every alert a case where it fires and one where it
//! stays quiet, every alert carries its annotations and a runbook that exists in docs/alerts.md, and
//! every metric they read is one warren exports.
//!
//! promtool comes from Debian's `prometheus` package (`scripts/setup.sh --with-promtool`);
//! without it these tests fail and say so.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::ops::{promtool, repo_path};

const RULES: &str = "prometheus/warren-alerts.yml";
const RULE_TESTS: &str = "prometheus/tests/warren-alerts.test.yml";
/// The page whose "Runbooks" section has one heading per alert.
const RUNBOOKS: &str = "docs/alerts.md";

fn read(relative: &str) -> String {
    std::fs::read_to_string(repo_path(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// One alerting rule of the rule file, as written.
#[derive(Debug)]
struct Alert {
    name: String,
    /// The rule's lines, from `- alert:` to the next rule.
    text: String,
}

impl Alert {
    /// The value of the first `key: value` line of the rule (quotes removed).
    fn value(&self, key: &str) -> Option<String> {
        self.text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix(key)?.strip_prefix(':')?;
            Some(rest.trim().trim_matches('"').trim_matches('\'').to_string())
        })
    }
}

/// Every `- alert:` rule of the rule file, in order.
fn alerts() -> Vec<Alert> {
    let text = read(RULES);
    let mut alerts: Vec<Alert> = Vec::new();
    for line in text.lines() {
        if let Some(name) = line.trim().strip_prefix("- alert:") {
            alerts.push(Alert {
                name: name.trim().to_string(),
                text: String::new(),
            });
        }
        if let Some(current) = alerts.last_mut() {
            current.text.push_str(line);
            current.text.push('\n');
        }
    }
    assert!(!alerts.is_empty(), "{RULES} has no alert");
    alerts
}

/// What the unit tests expect of each alert: (cases where it fires, cases where it is quiet).
fn test_cases() -> BTreeMap<String, (usize, usize)> {
    let text = read(RULE_TESTS);
    let mut cases: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("alertname:") {
            current = Some(name.trim().to_string());
        } else if let Some(expected) = line.strip_prefix("exp_alerts:")
            && let Some(name) = current.take()
        {
            let entry = cases.entry(name).or_default();
            if expected.trim() == "[]" {
                entry.1 += 1;
            } else {
                entry.0 += 1;
            }
        }
    }
    cases
}

/// The GitHub anchors of the headings of the "Runbooks" section of docs/alerts.md.
fn runbook_anchors() -> BTreeSet<String> {
    let page = read(RUNBOOKS);
    let start = page
        .find("\n## Runbooks\n")
        .unwrap_or_else(|| panic!("{RUNBOOKS} has no \"## Runbooks\" section"));
    let section = &page[start + 1..];
    let end = section[3..].find("\n## ").map_or(section.len(), |i| i + 3);
    section[..end]
        .lines()
        .filter_map(|l| l.strip_prefix("### "))
        .map(|heading| {
            heading
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect()
}

/// The metric families warren exports: the names in src/metrics.rs, with the `_bucket`,
/// `_sum` and `_count` series of its histograms.
fn exported_series() -> BTreeSet<String> {
    let source = read("src/metrics.rs");
    let compact: String = source.chars().filter(|c| !c.is_whitespace()).collect();
    let mut names = BTreeSet::new();
    for line in source.lines() {
        let Some(rest) = line.trim().strip_prefix("pub const ") else {
            continue;
        };
        let Some(name) = rest.split('"').nth(1).filter(|n| n.starts_with("warren_")) else {
            continue;
        };
        names.insert(name.to_string());
        // Histograms are described with describe_histogram!; their series carry suffixes.
        let constant = rest.split(':').next().unwrap_or("").trim();
        if compact.contains(&format!("describe_histogram!({constant},")) {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
    }
    names
}

/// The identifiers starting with `warren_` in an expression.
fn warren_identifiers(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("warren_") {
        let before = rest[..i].chars().last();
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '"') {
            out.insert(tail[..end].to_string());
        }
        rest = &tail[end..];
    }
    out
}

/// The rule's expression: the `expr:` line, or the folded block under `expr: >-`.
fn expression(alert: &Alert) -> String {
    let mut lines = alert
        .text
        .lines()
        .skip_while(|l| !l.trim().starts_with("expr:"));
    let first = lines
        .next()
        .unwrap_or_else(|| panic!("alert {} has no expr", alert.name));
    let inline = first.trim().trim_start_matches("expr:").trim();
    if inline != ">-" && inline != ">" && inline != "|" {
        return inline.to_string();
    }
    let indent = first.len() - first.trim_start().len();
    lines
        .take_while(|l| l.len() - l.trim_start().len() > indent || l.trim().is_empty())
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn promtool_accepts_the_rules() {
    let (ok, report) = promtool(&["check", "rules", RULES]);
    assert!(ok, "promtool check rules {RULES}:\n{report}");
    let n = alerts().len();
    assert!(
        report.contains(&format!("{n} rules found")),
        "promtool found another number of rules than the {n} alerts: {report}"
    );
}

#[test]
fn the_alert_unit_tests_pass() {
    let (ok, report) = promtool(&["test", "rules", RULE_TESTS]);
    assert!(ok, "promtool test rules {RULE_TESTS}:\n{report}");
}

#[test]
fn every_alert_is_tested_firing_and_quiet() {
    let cases = test_cases();
    let mut missing = Vec::new();
    for alert in alerts() {
        match cases.get(&alert.name) {
            Some((fires, quiet)) if *fires > 0 && *quiet > 0 => {}
            found => missing.push(format!(
                "{}: (firing, quiet) cases {:?}",
                alert.name,
                found.copied().unwrap_or_default()
            )),
        }
    }
    assert!(
        missing.is_empty(),
        "every alert needs a case where it fires and one where it stays quiet in {RULE_TESTS}:\n{}",
        missing.join("\n")
    );
    let names: BTreeSet<String> = alerts().into_iter().map(|a| a.name).collect();
    let unknown: Vec<&String> = cases.keys().filter(|n| !names.contains(*n)).collect();
    assert!(
        unknown.is_empty(),
        "{RULE_TESTS} tests unknown alerts {unknown:?}"
    );
}

#[test]
fn every_alert_has_a_severity_annotations_and_a_runbook_in_the_docs() {
    let anchors = runbook_anchors();
    let mut problems = Vec::new();
    let mut names = BTreeSet::new();
    for alert in alerts() {
        if !names.insert(alert.name.clone()) {
            problems.push(format!("{}: defined twice", alert.name));
        }
        match alert.value("severity").as_deref() {
            Some("critical" | "warning") => {}
            other => problems.push(format!(
                "{}: severity {other:?}, expected critical or warning",
                alert.name
            )),
        }
        for key in ["summary", "description"] {
            if alert.value(key).is_none_or(|v| v.is_empty()) {
                problems.push(format!("{}: no {key} annotation", alert.name));
            }
        }
        let expected = format!("{RUNBOOKS}#{}", alert.name.to_lowercase());
        match alert.value("runbook") {
            Some(runbook) if runbook == expected => {
                if !anchors.contains(&alert.name.to_lowercase()) {
                    problems.push(format!(
                        "{}: the \"Runbooks\" section of {RUNBOOKS} has no heading \"### {}\"",
                        alert.name, alert.name
                    ));
                }
            }
            other => problems.push(format!(
                "{}: runbook {other:?}, expected {expected:?}",
                alert.name
            )),
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_alert_reads_only_series_warren_exports() {
    let exported = exported_series();
    let mut unknown = Vec::new();
    for alert in alerts() {
        let expr = expression(&alert);
        let used = warren_identifiers(&expr);
        if used.is_empty() && !expr.contains("up{") {
            unknown.push(format!("{}: reads no warren series: {expr}", alert.name));
        }
        for name in used.difference(&exported) {
            unknown.push(format!("{}: {name} (in {expr})", alert.name));
        }
    }
    assert!(
        unknown.is_empty(),
        "series that src/metrics.rs does not export:\n{}",
        unknown.join("\n")
    );
}

#[test]
fn the_helpers_read_the_rule_file_as_written() {
    let alerts = alerts();
    let retry = alerts
        .iter()
        .find(|a| a.name == "WarrenRetryStorm")
        .expect("WarrenRetryStorm");
    let expr = expression(retry);
    assert!(
        expr.contains("rate(warren_messages_retried_total[5m])"),
        "{expr}"
    );
    assert!(expr.ends_with("> 0.1"), "{expr}");
    assert_eq!(
        warren_identifiers(&expr),
        BTreeSet::from([
            "warren_messages_received_total".to_string(),
            "warren_messages_retried_total".to_string()
        ])
    );
    assert!(exported_series().contains("warren_end_to_end_seconds_bucket"));
    assert!(!exported_series().contains("warren_breaker_open_bucket"));
}

#[test]
fn promtool_accepts_the_example_config_with_the_rules_and_file_sd_targets() {
    let (ok, report) = promtool(&["check", "config", "prometheus/prometheus.yml"]);
    assert!(
        ok,
        "promtool check config prometheus/prometheus.yml:\n{report}"
    );
    assert!(report.contains("1 rule files found"), "{report}");
    let targets = read("prometheus/targets/warren.yml");
    assert!(
        targets.contains("- targets:") && targets.contains("127.0.0.1:9901"),
        "prometheus/targets/warren.yml: {targets}"
    );
}

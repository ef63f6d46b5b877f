//! The Grafana dashboard's datasource: no uid is hard-wired. Every panel, target, query variable
//! and annotation queries through the data source variable `DS_PROMETHEUS`, whose default is the
//! provisioned datasource's uid (so provisioning opens on it), and `__inputs` declares the same
//! name, so that importing the file into an existing Grafana asks for a Prometheus and points
//! every query at it.

mod common;

use common::ops::repo_path;
use serde_json::Value;

const DASHBOARDS: &str = "grafana/dashboards";
const DATASOURCE: &str = "grafana/provisioning/datasources/prometheus.yml";
/// The input and variable every query goes through, and its reference.
const INPUT: &str = "DS_PROMETHEUS";
const REFERENCE: &str = "${DS_PROMETHEUS}";
/// Grafana's own annotation source, which is no Prometheus.
const GRAFANA_BUILT_IN: &str = "-- Grafana --";

/// Every dashboard under grafana/dashboards/: (file name, text).
fn dashboards() -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(repo_path(DASHBOARDS))
        .expect("grafana/dashboards")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy().into();
            (name, std::fs::read_to_string(&p).expect("read dashboard"))
        })
        .collect();
    out.sort();
    assert!(!out.is_empty(), "no dashboard in {DASHBOARDS}");
    out
}

fn parse(name: &str, text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{name} is not JSON: {e}"))
}

/// The uid the datasource provisioning file gives the Prometheus datasource.
fn provisioned_uid() -> String {
    let text = std::fs::read_to_string(repo_path(DATASOURCE)).expect("datasource provisioning");
    let uids: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("uid:"))
        .map(|v| v.trim().trim_matches(|c| c == '"' || c == '\'').to_string())
        .collect();
    assert_eq!(
        uids.len(),
        1,
        "{DATASOURCE}: one datasource uid, got {uids:?}"
    );
    uids[0].clone()
}

/// Every `datasource` reference in the dashboard, with a path to where it is: panels (rows'
/// nested panels too), targets, template variables, annotations, wherever they are.
fn datasource_refs(value: &Value, path: String, out: &mut Vec<(String, Value)>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                let here = match map.get("title").or(map.get("name")) {
                    Some(Value::String(t)) => format!("{path}/{t:?}.{key}"),
                    _ => format!("{path}.{key}"),
                };
                if key == "datasource" {
                    out.push((here.clone(), v.clone()));
                }
                datasource_refs(v, here, out);
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                datasource_refs(v, format!("{path}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// The uid a reference names (a bare string is the old by-name form).
fn uid_of(reference: &Value) -> Option<&str> {
    match reference {
        Value::Object(o) => o.get("uid").and_then(Value::as_str),
        Value::String(s) => Some(s),
        _ => None,
    }
}

#[test]
fn every_panel_target_and_variable_uses_the_datasource_variable() {
    for (name, text) in dashboards() {
        let d = parse(&name, &text);
        let mut refs = Vec::new();
        datasource_refs(&d, String::new(), &mut refs);
        let mut through_variable = 0;
        for (place, reference) in &refs {
            // The data source variable itself names only the kind of datasource it lists.
            if place.ends_with(&format!("{INPUT:?}.datasource")) {
                continue;
            }
            match uid_of(reference) {
                Some(GRAFANA_BUILT_IN) => {}
                Some(REFERENCE) => {
                    through_variable += 1;
                    assert_eq!(
                        reference["type"], "prometheus",
                        "{name} {place}: {reference}"
                    );
                }
                other => panic!(
                    "{name} {place}: datasource {other:?} is hard-wired; use \
                     {{\"type\": \"prometheus\", \"uid\": \"{REFERENCE}\"}}"
                ),
            }
        }
        // Every panel that queries, each of its targets, and each query variable.
        let panels = d["panels"].as_array().expect("panels");
        assert!(
            through_variable > panels.len(),
            "{name}: only {through_variable} references through {REFERENCE}"
        );
        for p in panels.iter().filter(|p| p["type"] != "row") {
            assert_eq!(
                uid_of(&p["datasource"]),
                Some(REFERENCE),
                "{name}: {}",
                p["title"]
            );
            for t in p["targets"].as_array().into_iter().flatten() {
                assert_eq!(
                    uid_of(&t["datasource"]),
                    Some(REFERENCE),
                    "{name}: {}",
                    p["title"]
                );
            }
        }
    }
}

#[test]
fn the_datasource_variable_defaults_to_the_provisioned_datasource() {
    let uid = provisioned_uid();
    for (name, text) in dashboards() {
        let d = parse(&name, &text);
        let vars = d["templating"]["list"].as_array().expect("templating.list");
        let var = vars
            .iter()
            .find(|v| v["name"] == INPUT)
            .unwrap_or_else(|| panic!("{name}: no template variable {INPUT}"));
        assert_eq!(var["type"], "datasource", "{name}: {var}");
        assert_eq!(
            var["query"], "prometheus",
            "{name}: lists Prometheus datasources"
        );
        assert_eq!(var["multi"], false, "{name}: one datasource at a time");
        assert_eq!(var["includeAll"], false, "{name}");
        assert_eq!(
            var["current"]["value"].as_str(),
            Some(uid.as_str()),
            "{name}: provisioning opens on the provisioned datasource ({DATASOURCE})"
        );
        // Variables are resolved in order: it must come before any that queries through it.
        assert_eq!(
            vars[0]["name"], INPUT,
            "{name}: {INPUT} is the first variable"
        );
    }
}

/// What Grafana's import does: it asks for each `__inputs` entry and replaces `${NAME}`
/// everywhere in the file with the chosen datasource's uid. Afterwards every query must point at
/// that uid, and none at a datasource of the machine the file came from.
#[test]
fn importing_asks_for_a_prometheus_and_points_every_query_at_it() {
    let uid = provisioned_uid();
    for (name, text) in dashboards() {
        let d = parse(&name, &text);
        let inputs = d["__inputs"].as_array().expect("__inputs for import");
        assert_eq!(inputs.len(), 1, "{name}: one input: {inputs:?}");
        assert_eq!(inputs[0]["name"], INPUT, "{name}");
        assert_eq!(inputs[0]["type"], "datasource", "{name}");
        assert_eq!(inputs[0]["pluginId"], "prometheus", "{name}");
        assert!(
            d["__requires"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x["id"] == "prometheus")),
            "{name}: __requires names the prometheus datasource plugin"
        );

        let chosen = "their-prometheus-uid";
        let imported = parse(&name, &text.replace(REFERENCE, chosen));
        let mut refs = Vec::new();
        datasource_refs(&imported, String::new(), &mut refs);
        for (place, reference) in &refs {
            if place.ends_with(&format!("{INPUT:?}.datasource")) {
                continue;
            }
            let got = uid_of(reference);
            assert!(
                got == Some(chosen) || got == Some(GRAFANA_BUILT_IN),
                "{name} {place}: after import points at {got:?}, not the chosen {chosen}"
            );
        }
        assert!(
            !imported.to_string().contains("${"),
            "{name}: an unresolved ${{...}} other than the input remains after import"
        );
        // The provisioned uid is left only in the variable (its default, which Grafana replaces
        // with an existing datasource when it has none of that uid).
        let mut rest = imported.clone();
        if let Some(vars) = rest["templating"]["list"].as_array_mut() {
            vars.retain(|v| v["name"] != INPUT);
        }
        assert!(
            !rest.to_string().contains(&uid),
            "{name}: {uid} is still named outside the variable {INPUT} after import"
        );
    }
}

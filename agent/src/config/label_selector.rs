//! Kubernetes label selectors (`matchLabels` + `matchExpressions` with In,
//! NotIn, Exists, DoesNotExist), as a Network's `namespaceSelector` uses
//! them, with Kubernetes' semantics: every term must hold; an empty
//! selector matches everything.

use std::{collections::BTreeMap, fmt};

use serde::{Deserialize, Serialize};

/// A namespace's (or any object's) labels.
pub type Labels = BTreeMap<String, String>;

/// The label every Kubernetes namespace carries with its own name (set by
/// the API server since 1.21), so a selector can name namespaces.
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq, Eq)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    #[serde(default)]
    pub values: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default)]
    pub match_labels: Labels,
    #[serde(default)]
    pub match_expressions: Vec<Requirement>,
}

impl LabelSelector {
    /// Whether `labels` satisfy every term.
    pub fn matches(&self, labels: &Labels) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.match_expressions.iter().all(|r| r.matches(labels))
    }

    /// Refuses what Kubernetes refuses: In/NotIn without values,
    /// Exists/DoesNotExist with values, empty keys. `Err` is (field under
    /// the selector, message).
    pub fn check(&self) -> Result<(), (String, String)> {
        if self.match_labels.keys().any(String::is_empty) {
            return Err(("matchLabels".into(), "a label key is empty".into()));
        }
        for (i, r) in self.match_expressions.iter().enumerate() {
            let at = |f: &str| format!("matchExpressions[{i}].{f}");
            if r.key.is_empty() {
                return Err((at("key"), "must not be empty".into()));
            }
            match r.operator {
                Operator::In | Operator::NotIn if r.values.is_empty() => {
                    return Err((
                        at("values"),
                        format!("{:?} needs at least one value", r.operator),
                    ));
                }
                Operator::Exists | Operator::DoesNotExist if !r.values.is_empty() => {
                    return Err((at("values"), format!("{:?} takes no values", r.operator)));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl Requirement {
    fn matches(&self, labels: &Labels) -> bool {
        let value = labels.get(&self.key);
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.contains(v)),
            // Kubernetes: NotIn also matches objects without the label.
            Operator::NotIn => value.is_none_or(|v| !self.values.contains(v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
        }
    }
}

/// As written in a document, for messages: `{matchLabels: {team: blue},
/// matchExpressions: [{key: env, operator: In, values: [prod]}]}`.
impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if !self.match_labels.is_empty() {
            parts.push(format!("matchLabels: {}", show_labels(&self.match_labels)));
        }
        if !self.match_expressions.is_empty() {
            let exprs: Vec<String> = self
                .match_expressions
                .iter()
                .map(|r| {
                    let values = if r.values.is_empty() {
                        String::new()
                    } else {
                        format!(", values: [{}]", r.values.join(", "))
                    };
                    format!("{{key: {}, operator: {:?}{values}}}", r.key, r.operator)
                })
                .collect();
            parts.push(format!("matchExpressions: [{}]", exprs.join(", ")));
        }
        write!(f, "{{{}}}", parts.join(", "))
    }
}

/// `{k: v, k: v}`.
pub fn show_labels(labels: &Labels) -> String {
    let kv: Vec<String> = labels.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    format!("{{{}}}", kv.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> Labels {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn selector(yaml: &str) -> LabelSelector {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn an_empty_selector_matches_every_namespace() {
        let s = selector("{}");
        assert!(s.matches(&labels(&[])));
        assert!(s.matches(&labels(&[("team", "red")])));
    }

    #[test]
    fn match_labels_need_every_pair() {
        let s = selector("matchLabels: {team: blue, env: prod}");
        assert!(s.matches(&labels(&[("team", "blue"), ("env", "prod"), ("x", "y")])));
        assert!(!s.matches(&labels(&[("team", "blue")])));
        assert!(!s.matches(&labels(&[("team", "red"), ("env", "prod")])));
    }

    #[test]
    fn each_operator_as_kubernetes_defines_it() {
        // (expression, the namespace's labels, matches)
        type Row = (&'static str, &'static [(&'static str, &'static str)], bool);
        let table: &[Row] = &[
            (
                "{key: env, operator: In, values: [prod, staging]}",
                &[("env", "prod")],
                true,
            ),
            (
                "{key: env, operator: In, values: [prod, staging]}",
                &[("env", "dev")],
                false,
            ),
            ("{key: env, operator: In, values: [prod]}", &[], false),
            (
                "{key: env, operator: NotIn, values: [dev]}",
                &[("env", "prod")],
                true,
            ),
            (
                "{key: env, operator: NotIn, values: [dev]}",
                &[("env", "dev")],
                false,
            ),
            ("{key: env, operator: NotIn, values: [dev]}", &[], true),
            ("{key: env, operator: Exists}", &[("env", "")], true),
            ("{key: env, operator: Exists}", &[], false),
            ("{key: env, operator: DoesNotExist}", &[], true),
            ("{key: env, operator: DoesNotExist}", &[("env", "x")], false),
        ];
        for (expr, have, want) in table {
            let s = selector(&format!("matchExpressions: [{expr}]"));
            s.check().unwrap();
            assert_eq!(s.matches(&labels(have)), *want, "{expr} on {have:?}");
        }
    }

    #[test]
    fn labels_and_expressions_must_all_hold() {
        let s = selector(
            "matchLabels: {team: blue}\nmatchExpressions: [{key: env, operator: NotIn, values: [dev]}]",
        );
        assert!(s.matches(&labels(&[("team", "blue")])));
        assert!(!s.matches(&labels(&[("team", "blue"), ("env", "dev")])));
        assert!(!s.matches(&labels(&[("env", "prod")])));
        assert_eq!(
            s.to_string(),
            "{matchLabels: {team: blue}, matchExpressions: [{key: env, operator: NotIn, values: [dev]}]}"
        );
    }

    #[test]
    fn malformed_selectors_are_refused_naming_the_field() {
        for (yaml, field) in [
            (
                "matchExpressions: [{key: env, operator: In}]",
                "matchExpressions[0].values",
            ),
            (
                "matchExpressions: [{key: a, operator: Exists}, {key: env, operator: DoesNotExist, values: [x]}]",
                "matchExpressions[1].values",
            ),
            (
                "matchExpressions: [{key: '', operator: Exists}]",
                "matchExpressions[0].key",
            ),
        ] {
            assert_eq!(selector(yaml).check().unwrap_err().0, field, "{yaml}");
        }
        assert!(
            serde_saphyr::from_str::<LabelSelector>(
                "matchExpressions: [{key: a, operator: Gt, values: ['1']}]"
            )
            .is_err(),
            "Gt is a node-selector operator, not a label selector's"
        );
    }
}

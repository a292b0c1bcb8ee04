//! Kubernetes label selectors (`matchLabels` + `matchExpressions` with In,
//! NotIn, Exists, DoesNotExist), as a Network's `namespaceSelector` uses
//! them, with Kubernetes' semantics: every term must hold; an empty
//! selector matches everything.

use std::{collections::BTreeMap, fmt};

use serde::{Deserialize, Serialize};

use crate::sys::intern::Name;

/// A namespace's (or any object's) labels: a map of label keys to values,
/// kept as one sorted list. Objects carry a few labels each, and every VM
/// interface of the cluster holds its VM's: a `BTreeMap` allocates a node
/// of eleven slots for the first (about 550 bytes of `String` pairs),
/// which was the largest single part of what the agent held per VM at
/// 10,000 VMs (issue 34).
///
/// Keys and values are [`Name`]s: a VM's labels are held by its VMI's
/// copy and by its Attachment, and their keys by every VM. A boxed slice,
/// not a `Vec`: every object kept holds two (labels and annotations), and
/// a `Vec`'s capacity word made a VMI a size class larger.
#[derive(Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Labels(Box<[(Name, Name)]>);

impl Labels {
    pub fn new() -> Self {
        Self::default()
    }

    fn position(&self, key: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(k, _)| k.as_str().cmp(key))
    }

    pub fn get(&self, key: &str) -> Option<&Name> {
        self.position(key).ok().map(|i| &self.0[i].1)
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.position(key).is_ok()
    }

    /// Sets `key` to `value`; returns the value it replaced.
    pub fn insert(&mut self, key: impl Into<Name>, value: impl Into<Name>) -> Option<Name> {
        let (key, value) = (key.into(), value.into());
        match self.position(&key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                let mut pairs = std::mem::take(&mut self.0).into_vec();
                pairs.insert(i, (key, value));
                self.0 = pairs.into_boxed_slice();
                None
            }
        }
    }

    pub fn remove(&mut self, key: &str) -> Option<Name> {
        let i = self.position(key).ok()?;
        let mut pairs = std::mem::take(&mut self.0).into_vec();
        let (_, value) = pairs.remove(i);
        self.0 = pairs.into_boxed_slice();
        Some(value)
    }

    pub fn retain(&mut self, mut keep: impl FnMut(&str, &str) -> bool) {
        let mut pairs = std::mem::take(&mut self.0).into_vec();
        pairs.retain(|(k, v)| keep(k, v));
        self.0 = pairs.into_boxed_slice();
    }

    /// Key and value, by key.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&Name, &Name)> + Clone {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub fn keys(&self) -> impl ExactSizeIterator<Item = &Name> + Clone {
        self.0.iter().map(|(k, _)| k)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<Name>, V: Into<Name>> FromIterator<(K, V)> for Labels {
    /// As a map collects: a later value of a key wins.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut pairs: Vec<(Name, Name)> = iter
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        // Stable: equal keys stay in order, and the last of each is kept.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut out: Vec<(Name, Name)> = Vec::with_capacity(pairs.len());
        for pair in pairs {
            match out.last_mut() {
                Some(last) if last.0 == pair.0 => *last = pair,
                _ => out.push(pair),
            }
        }
        Labels(out.into_boxed_slice())
    }
}

impl<K: Into<Name>, V: Into<Name>> Extend<(K, V)> for Labels {
    /// One sort for the lot (a tenant's pod may carry many labels: one
    /// insert each would move the list once per label).
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        let mut pairs = std::mem::take(&mut self.0).into_vec();
        pairs.extend(iter.into_iter().map(|(k, v)| (k.into(), v.into())));
        *self = pairs.into_iter().collect();
    }
}

impl From<BTreeMap<String, String>> for Labels {
    fn from(map: BTreeMap<String, String>) -> Self {
        // Already sorted and unique.
        Labels(map.into_iter().map(|(k, v)| (k.into(), v.into())).collect())
    }
}

impl<'a> IntoIterator for &'a Labels {
    type Item = (&'a Name, &'a Name);
    type IntoIter = std::iter::Map<
        std::slice::Iter<'a, (Name, Name)>,
        fn(&'a (Name, Name)) -> (&'a Name, &'a Name),
    >;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(k, v)| (k, v))
    }
}

impl IntoIterator for Labels {
    type Item = (Name, Name);
    type IntoIter = std::vec::IntoIter<(Name, Name)>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_vec().into_iter()
    }
}

impl fmt::Debug for Labels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Labels {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Labels {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<Name, Name>::deserialize(deserializer)
            .map(|map| Labels(map.into_iter().collect()))
    }
}

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
        if self.match_labels.keys().any(|k| k.is_empty()) {
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
            Operator::In => value.is_some_and(|v| self.values.iter().any(|x| *x == **v)),
            // Kubernetes: NotIn also matches objects without the label.
            Operator::NotIn => value.is_none_or(|v| !self.values.iter().any(|x| *x == **v)),
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

    /// Labels behave as the map they stand for: one value a key, the
    /// last one given winning, in key order, and read and written as a
    /// YAML/JSON map.
    #[test]
    fn labels_are_a_map_by_key() {
        let mut l = labels(&[("b", "1"), ("a", "2"), ("b", "3")]);
        assert_eq!(l.len(), 2);
        assert_eq!(l.get("b").map(|v| v.as_str()), Some("3"));
        assert_eq!(l.keys().map(|v| v.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(l.insert("c", "4"), None);
        assert_eq!(l.insert("a", "5").map(String::from), Some("2".into()));
        assert!(l.contains_key("c") && !l.contains_key("d"));
        assert_eq!(l.remove("c").map(String::from), Some("4".into()));
        l.retain(|k, _| k != "a");
        assert_eq!(l, labels(&[("b", "3")]));
        let json = serde_json::to_string(&labels(&[("z", "1"), ("y", "2")])).unwrap();
        assert_eq!(json, r#"{"y":"2","z":"1"}"#);
        let back: Labels = serde_json::from_str(&json).unwrap();
        assert_eq!(back, labels(&[("y", "2"), ("z", "1")]));
        assert!(serde_json::from_str::<Labels>(r#"{"a": 1}"#).is_err());
    }
}

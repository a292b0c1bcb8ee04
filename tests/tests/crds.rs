//! The Network CRD (deploy/crds/network.yaml) against the agent's own
//! Network type, in both directions: a Network using every field of the
//! schema (each enum value in turn) is read by the agent with nothing
//! refused, and every field the agent's type has is in the schema. Every
//! example Network in docs/examples and deploy/ passes the schema, and a
//! misspelt field, a bad enum value, a missing `id` or too long a list do
//! not, as the API server would refuse them.

use std::{fs, path::PathBuf};

use serde_json::{Map, Value, json};
use vmpath_tests::vmpath::config::{model::NetworkSpec, source::limits};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn yaml_docs(text: &str, what: &str) -> Vec<Value> {
    serde_saphyr::from_multiple::<Value>(text)
        .unwrap_or_else(|e| panic!("{what}: not valid YAML: {e}"))
        .into_iter()
        .filter(|v| !v.is_null())
        .collect()
}

/// The schema of a Network object (`openAPIV3Schema` of the served version).
fn network_schema() -> Value {
    let path = repo().join("deploy/crds/network.yaml");
    let text = fs::read_to_string(&path).unwrap();
    let docs = yaml_docs(&text, "deploy/crds/network.yaml");
    assert_eq!(docs.len(), 1);
    let crd = &docs[0];
    assert_eq!(crd["spec"]["group"], "vmpath.dev");
    assert_eq!(crd["spec"]["names"]["kind"], "Network");
    let versions = crd["spec"]["versions"].as_array().unwrap();
    let served: Vec<_> = versions.iter().filter(|v| v["served"] == true).collect();
    assert_eq!(served.len(), 1, "one served version");
    assert_eq!(served[0]["name"], "v1alpha1");
    served[0]["schema"]["openAPIV3Schema"].clone()
}

/// A value with every property of `schema` set, from its `example`s; an
/// enum takes its `pick`-th value (the last when it has fewer).
fn sample(schema: &Value, path: &str, pick: usize) -> Value {
    if let Some(values) = schema["enum"].as_array() {
        return values[pick.min(values.len() - 1)].clone();
    }
    if !schema["example"].is_null() {
        return schema["example"].clone();
    }
    match schema["type"].as_str() {
        Some("object") => {
            let props = schema["properties"]
                .as_object()
                .unwrap_or_else(|| panic!("{path}: an object with neither properties nor example"));
            Value::Object(
                props
                    .iter()
                    .map(|(k, s)| (k.clone(), sample(s, &format!("{path}.{k}"), pick)))
                    .collect(),
            )
        }
        Some("array") => json!([sample(&schema["items"], &format!("{path}[]"), pick)]),
        Some("boolean") => json!(true),
        Some("integer") => schema["minimum"].as_i64().map_or(json!(1), Value::from),
        other => panic!("{path}: type {other:?} without an example"),
    }
}

/// The longest enum of `schema`, to try each value once.
fn widest_enum(schema: &Value) -> usize {
    let own = schema["enum"].as_array().map_or(0, Vec::len);
    let props = schema["properties"]
        .as_object()
        .map_or(0, |p| p.values().map(widest_enum).max().unwrap_or(0));
    own.max(props).max(widest_enum_items(schema))
}

fn widest_enum_items(schema: &Value) -> usize {
    if schema["items"].is_object() {
        widest_enum(&schema["items"])
    } else {
        0
    }
}

/// Keys of `value` (as the agent writes its type) the schema lacks.
fn unknown_to_schema(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if schema["additionalProperties"].is_object()
                || schema["x-kubernetes-preserve-unknown-fields"] == true
            {
                return;
            }
            for (k, v) in map {
                match schema["properties"].get(k) {
                    Some(s) => unknown_to_schema(v, s, &format!("{path}.{k}"), out),
                    None => out.push(format!("{path}.{k}")),
                }
            }
        }
        Value::Array(items) => {
            for v in items {
                unknown_to_schema(v, &schema["items"], &format!("{path}[]"), out);
            }
        }
        _ => {}
    }
}

/// What the API server would refuse in `value` under `schema` (the subset
/// of OpenAPI v3 a structural CRD schema uses here): the reasons, by path.
fn refusals(value: &Value, schema: &Value, path: &str) -> Vec<String> {
    let mut out = Vec::new();
    let ty = schema["type"].as_str();
    let type_ok = match (ty, value) {
        (None, _) => true,
        (Some("object"), Value::Object(_))
        | (Some("array"), Value::Array(_))
        | (Some("string"), Value::String(_))
        | (Some("boolean"), Value::Bool(_)) => true,
        (Some("integer"), Value::Number(n)) => n.is_i64() || n.is_u64(),
        _ => false,
    };
    if !type_ok {
        return vec![format!("{path}: expected {}, got {value}", ty.unwrap())];
    }
    if let Some(values) = schema["enum"].as_array()
        && !values.contains(value)
    {
        out.push(format!("{path}: {value} is not one of {values:?}"));
    }
    if let Some(n) = value.as_f64() {
        if schema["minimum"].as_f64().is_some_and(|m| n < m) {
            out.push(format!("{path}: {n} below the minimum"));
        }
        if schema["maximum"].as_f64().is_some_and(|m| n > m) {
            out.push(format!("{path}: {n} above the maximum"));
        }
    }
    match value {
        Value::Object(map) => {
            for r in schema["required"].as_array().into_iter().flatten() {
                if !map.contains_key(r.as_str().unwrap()) {
                    out.push(format!("{path}: {r} is required"));
                }
            }
            for (k, v) in map {
                let p = format!("{path}.{k}");
                if let Some(s) = schema["properties"].get(k) {
                    out.extend(refusals(v, s, &p));
                } else if schema["additionalProperties"].is_object() {
                    out.extend(refusals(v, &schema["additionalProperties"], &p));
                } else if schema["x-kubernetes-preserve-unknown-fields"] != true
                    && schema["properties"].is_object()
                {
                    out.push(format!("{p}: unknown field"));
                }
            }
        }
        Value::Array(items) => {
            if schema["maxItems"]
                .as_u64()
                .is_some_and(|m| items.len() as u64 > m)
            {
                out.push(format!("{path}: more than {} items", schema["maxItems"]));
            }
            for (i, v) in items.iter().enumerate() {
                out.extend(refusals(v, &schema["items"], &format!("{path}[{i}]")));
            }
        }
        _ => {}
    }
    out
}

#[test]
fn the_network_crd_and_the_agents_network_type_have_the_same_fields() {
    let schema = network_schema();
    let spec_schema = &schema["properties"]["spec"];
    assert!(spec_schema.is_object(), "no spec in the schema");

    // The list bounds are the agent's own: a list the API server stores
    // is one the agent reads.
    let p = &spec_schema["properties"];
    for (field, max) in [
        (&p["subnets"], limits::MAX_SHORT_LIST),
        (&p["defaultGatewayIPs"], limits::MAX_SHORT_LIST),
        (&p["excludeSubnets"], limits::MAX_LONG_LIST),
        (
            &p["dhcp"]["properties"]["dnsServers"],
            limits::MAX_SHORT_LIST,
        ),
        (
            &p["dhcp"]["properties"]["searchDomains"],
            limits::MAX_SHORT_LIST,
        ),
        (&p["dhcp"]["properties"]["routes"], limits::MAX_LONG_LIST),
    ] {
        assert_eq!(field["maxItems"].as_u64(), Some(max as u64), "{field}");
    }

    for pick in 0..widest_enum(spec_schema).max(1) {
        let spec = sample(spec_schema, "spec", pick);
        assert!(
            refusals(&spec, spec_schema, "spec").is_empty(),
            "the schema's own sample is refused: {:?}",
            refusals(&spec, spec_schema, "spec")
        );
        // Schema -> agent: everything the schema allows, the agent reads
        // (its type refuses unknown fields).
        let parsed: NetworkSpec = serde_json::from_value(spec.clone()).unwrap_or_else(|e| {
            panic!("the agent refuses a Network the CRD allows ({e}):\n{spec:#}")
        });
        // Agent -> schema: every field the agent's type has, the schema has.
        let written = serde_json::to_value(&parsed).unwrap();
        let mut missing = Vec::new();
        unknown_to_schema(&written, spec_schema, "spec", &mut missing);
        assert!(
            missing.is_empty(),
            "fields of the agent's Network missing from deploy/crds/network.yaml: {missing:?}"
        );
    }
}

/// Every Network document in docs/examples and in deploy/configmap.yaml.
fn example_networks() -> Vec<(String, Value)> {
    let mut texts = Vec::new();
    for entry in fs::read_dir(repo().join("docs/examples")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            texts.push((
                path.display().to_string(),
                fs::read_to_string(&path).unwrap(),
            ));
        }
    }
    let cm_text = fs::read_to_string(repo().join("deploy/configmap.yaml")).unwrap();
    for cm in yaml_docs(&cm_text, "deploy/configmap.yaml") {
        for (key, text) in cm["data"].as_object().into_iter().flatten() {
            if key.ends_with(".yaml") {
                texts.push((format!("configmap {key}"), text.as_str().unwrap().into()));
            }
        }
    }
    texts
        .iter()
        .flat_map(|(what, text)| {
            yaml_docs(text, what)
                .into_iter()
                .filter(|d| d["kind"] == "Network")
                .map(move |d| (what.clone(), d))
        })
        .collect()
}

#[test]
fn every_example_network_passes_the_crd_and_bad_ones_do_not() {
    let schema = network_schema();
    let examples = example_networks();
    assert!(examples.len() >= 3, "examples found: {}", examples.len());
    for (what, doc) in &examples {
        let r = refusals(doc, &schema, "");
        assert!(
            r.is_empty(),
            "{what}: {} refused: {r:?}",
            doc["metadata"]["name"]
        );
    }

    let good = examples[0].1.clone();
    let bad = |f: &dyn Fn(&mut Map<String, Value>)| {
        let mut d = good.clone();
        f(d["spec"].as_object_mut().unwrap());
        refusals(&d, &schema, "")
    };
    let misspelt = bad(&|s| {
        s.insert("subnet".into(), json!(["10.0.0.0/8"]));
    });
    assert_eq!(misspelt, [".spec.subnet: unknown field"]);
    let egress = bad(&|s| {
        s.insert("egress".into(), json!("NAT"));
    });
    assert!(
        egress[0].starts_with(".spec.egress: \"NAT\" is not one of"),
        "{egress:?}"
    );
    let no_id = bad(&|s| {
        s.remove("id");
    });
    assert_eq!(no_id, [".spec: \"id\" is required"]);
    let too_many = bad(&|s| {
        let subnets: Vec<_> = (0..17).map(|i| format!("10.{i}.0.0/16")).collect();
        s.insert("subnets".into(), json!(subnets));
    });
    assert_eq!(too_many, [".spec.subnets: more than 16 items"]);
    let id = bad(&|s| {
        s.insert("id".into(), json!(0));
    });
    assert_eq!(id, [".spec.id: 0 below the minimum"]);
}

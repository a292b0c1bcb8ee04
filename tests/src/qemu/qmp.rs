//! A minimal QMP client: one command at a time, events kept aside.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

pub struct Qmp {
    writer: UnixStream,
    reader: BufReader<UnixStream>,
    /// Events seen so far, in order.
    pub events: Vec<Value>,
}

impl Qmp {
    pub fn connect(path: &Path) -> Qmp {
        let deadline = Instant::now() + Duration::from_secs(10);
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(Instant::now() < deadline, "QMP {}: {e}", path.display());
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        };
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut qmp = Qmp {
            writer: stream.try_clone().unwrap(),
            reader: BufReader::new(stream),
            events: Vec::new(),
        };
        let greeting = qmp.read();
        assert!(greeting.get("QMP").is_some(), "QMP greeting: {greeting}");
        qmp.execute("qmp_capabilities", json!({}));
        qmp
    }

    fn read(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("reading QMP");
        assert!(n > 0, "QMP closed");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("QMP sent {line:?}: {e}"))
    }

    /// Runs a command; panics on a QMP error. Returns its `return` value.
    pub fn execute(&mut self, command: &str, arguments: Value) -> Value {
        let msg = json!({"execute": command, "arguments": arguments});
        self.writer
            .write_all(format!("{msg}\n").as_bytes())
            .expect("writing QMP");
        loop {
            let v = self.read();
            if v.get("event").is_some() {
                self.events.push(v);
                continue;
            }
            if let Some(e) = v.get("error") {
                panic!("QMP {command} failed: {e}");
            }
            return v["return"].clone();
        }
    }

    /// Wall-clock time (s) of the first event `name` seen so far.
    pub fn event_time(&self, name: &str) -> Option<f64> {
        self.events
            .iter()
            .find(|e| e["event"] == name)
            .and_then(|e| {
                let t = &e["timestamp"];
                Some(t["seconds"].as_f64()? + t["microseconds"].as_f64()? / 1e6)
            })
    }

    pub fn status(&mut self) -> String {
        self.execute("query-status", json!({}))["status"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    }

    pub fn wait_status(&mut self, want: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = self.status();
            if s == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "QEMU status {s}, waiting for {want}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

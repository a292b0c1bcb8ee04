//! The agent's admin API: JSON over HTTP/1.1 on a unix socket. One request
//! per connection, so a few lines of client are enough.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

/// Longer than the agent's own wait for a port to be programmed.
const TIMEOUT: Duration = Duration::from_secs(15);

/// An answer: status code and body.
pub struct Answer {
    pub code: u16,
    pub body: String,
}

impl Answer {
    /// The agent's `{"error": "..."}` message, or the raw body.
    pub fn message(&self) -> String {
        serde_json::from_str::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_string))
            .unwrap_or_else(|| self.body.trim().to_string())
    }
}

/// Sends one request; `Err` means the agent could not be reached.
pub fn request(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Answer, String> {
    let unreachable = |e: std::io::Error| {
        format!(
            "the vmpath agent is not reachable on {}: {e}",
            socket.display()
        )
    };
    let mut stream = UnixStream::connect(socket).map_err(unreachable)?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .map_err(unreachable)?;
    stream
        .set_write_timeout(Some(TIMEOUT))
        .map_err(unreachable)?;
    let body = body.unwrap_or("");
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: vmpath\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream
        .write_all(head.as_bytes())
        .and_then(|()| stream.write_all(body.as_bytes()))
        .map_err(unreachable)?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).map_err(|e| {
        format!(
            "no answer from the vmpath agent on {} to {method} {path}: {e}",
            socket.display()
        )
    })?;
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("the vmpath agent answered {method} {path} with no status"))?;
    Ok(Answer {
        code,
        body: body.to_string(),
    })
}

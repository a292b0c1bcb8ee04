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
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| {
        format!(
            "no answer from the vmpath agent on {} to {method} {path}: {e}",
            socket.display()
        )
    })?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n");
    let (head, body) = match split {
        Some(at) => (&raw[..at], &raw[at + 4..]),
        None => (&raw[..], &[][..]),
    };
    let head = String::from_utf8_lossy(head);
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("the vmpath agent answered {method} {path} with no status"))?;
    // A large answer (a network with many attachments) comes in chunks.
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding")
                && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked {
        dechunk(body).ok_or_else(|| {
            format!("the vmpath agent's answer to {method} {path} has a broken chunked body")
        })?
    } else {
        body.to_vec()
    };
    let body = String::from_utf8_lossy(&body).into_owned();
    Ok(Answer { code, body })
}

/// The payload of an HTTP/1.1 chunked body (RFC 9112 section 7.1): hex
/// size lines (extensions ignored), each chunk followed by CRLF, a zero
/// chunk last. Bytes, since a chunk may end inside a UTF-8 character.
/// `None` when it is cut short or malformed.
fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_line = std::str::from_utf8(&rest[..eol]).ok()?;
        let size_hex = size_line.split(';').next()?.trim();
        let size = usize::from_str_radix(size_hex, 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        let chunk = rest.get(eol + 2..eol + 2 + size)?;
        out.extend_from_slice(chunk);
        rest = rest.get(eol + 2 + size..)?.strip_prefix(b"\r\n")?;
    }
}

#[cfg(test)]
mod tests {
    use super::dechunk;

    #[test]
    fn chunked_bodies_are_joined_and_broken_ones_refused() {
        let d = |s: &str| dechunk(s.as_bytes()).map(|b| String::from_utf8(b).unwrap());
        assert_eq!(
            d("5\r\n{\"a\":\r\n2;ext=1\r\n1}\r\n0\r\n\r\n").as_deref(),
            Some("{\"a\":1}")
        );
        assert_eq!(d("0\r\n\r\n").as_deref(), Some(""));
        assert_eq!(d("5\r\nab"), None, "cut short");
        assert_eq!(d("zz\r\nab\r\n0\r\n\r\n"), None, "not hex");
        assert_eq!(d("2\r\nabX\r\n0\r\n\r\n"), None, "no CRLF after the chunk");
        // A character split across two chunks.
        assert_eq!(
            dechunk(b"1\r\n\xc3\r\n1\r\n\xa9\r\n0\r\n\r\n").as_deref(),
            Some("\u{e9}".as_bytes())
        );
    }
}

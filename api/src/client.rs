//! The one client of the agent's socket, for the CLI and the CNI plugin:
//! one request per connection (`Connection: close`), so the answer is
//! everything up to EOF.

use std::{
    io::{self, BufRead as _, BufReader, Read as _, Write as _},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::types::ApiError;

/// Longer than the agent's own wait for a CNI port to be programmed
/// ([`crate::cni::PROGRAM_TIMEOUT`]), so an ADD gets the agent's answer.
pub const TIMEOUT: Duration = Duration::from_secs(15);

/// Why a request got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("the vmpath agent is not reachable on {}: {}", socket.display(), connect_reason(source))]
    Connect {
        socket: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("sending {method} {path} to the vmpath agent on {}: {source}", socket.display())]
    Send {
        socket: PathBuf,
        method: String,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("no answer from the vmpath agent on {} to {method} {path}: {source}", socket.display())]
    Receive {
        socket: PathBuf,
        method: String,
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("the vmpath agent's answer to {method} {path} {what}")]
    Malformed {
        method: String,
        path: String,
        what: &'static str,
    },
    /// An answer other than 200, with the agent's own message.
    #[error("{message} (HTTP {code})")]
    Status { code: u16, message: String },
}

fn connect_reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::PermissionDenied => format!("permission denied: the API is root-only ({e})"),
        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
            format!("agent not running: nothing listens there ({e})")
        }
        _ => e.to_string(),
    }
}

/// An answer: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub code: u16,
    pub body: String,
}

impl Answer {
    /// The agent's `{"error": "..."}` message, or the raw body.
    pub fn message(&self) -> String {
        message_of(&self.body)
    }

    /// The body of a 200 answer; any other is [`ClientError::Status`].
    pub fn success(self) -> Result<String, ClientError> {
        if self.code == 200 {
            Ok(self.body)
        } else {
            Err(ClientError::Status {
                code: self.code,
                message: self.message(),
            })
        }
    }
}

fn message_of(body: &str) -> String {
    serde_json::from_str::<ApiError>(body)
        .map(|e| e.error)
        .unwrap_or_else(|_| body.trim().to_string())
}

/// The agent's socket.
#[derive(Debug, Clone)]
pub struct Client {
    socket: PathBuf,
    timeout: Duration,
}

impl Client {
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Client {
            socket: socket.into(),
            timeout: TIMEOUT,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Result<Answer, ClientError> {
        self.request("GET", path, None)
    }

    /// Sends one request and reads the whole answer.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<Answer, ClientError> {
        let mut stream = self.send(method, path, body)?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(|e| self.receive_error(method, path, e))?;
        let mut raw = Vec::new();
        stream
            .read_to_end(&mut raw)
            .map_err(|e| self.receive_error(method, path, e))?;
        parse(&raw).map_err(|what| ClientError::Malformed {
            method: method.into(),
            path: path.into(),
            what,
        })
    }

    /// `GET path` whose answer streams until the agent or the reader
    /// stops (`/v1/monitor`): the body's reader once the agent answered
    /// 200, without a read timeout.
    pub fn stream(&self, path: &str) -> Result<BufReader<UnixStream>, ClientError> {
        let stream = self.send("GET", path, None)?;
        let mut reader = BufReader::new(stream);
        let receive = |e| self.receive_error("GET", path, e);
        let mut status = String::new();
        reader.read_line(&mut status).map_err(receive)?;
        let code = status_code(&status).ok_or_else(|| ClientError::Malformed {
            method: "GET".into(),
            path: path.into(),
            what: "has no status",
        })?;
        // The headers, up to the blank line.
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).map_err(receive)? == 0 || line.trim().is_empty() {
                break;
            }
        }
        if code != 200 {
            let mut body = String::new();
            reader.read_to_string(&mut body).map_err(receive)?;
            return Err(ClientError::Status {
                code,
                message: message_of(&body),
            });
        }
        Ok(reader)
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&str>,
    ) -> Result<UnixStream, ClientError> {
        let mut stream =
            UnixStream::connect(&self.socket).map_err(|source| ClientError::Connect {
                socket: self.socket.clone(),
                source,
            })?;
        let body = body.unwrap_or("");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: vmpath\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream
            .set_write_timeout(Some(self.timeout))
            .and_then(|()| stream.write_all(head.as_bytes()))
            .and_then(|()| stream.write_all(body.as_bytes()))
            .map_err(|source| ClientError::Send {
                socket: self.socket.clone(),
                method: method.into(),
                path: path.into(),
                source,
            })?;
        Ok(stream)
    }

    fn receive_error(&self, method: &str, path: &str, source: io::Error) -> ClientError {
        ClientError::Receive {
            socket: self.socket.clone(),
            method: method.into(),
            path: path.into(),
            source,
        }
    }
}

fn status_code(status_line: &str) -> Option<u16> {
    status_line.split_whitespace().nth(1)?.parse().ok()
}

/// Status and body of a whole HTTP/1.x answer.
fn parse(raw: &[u8]) -> Result<Answer, &'static str> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n");
    let (head, body) = match split {
        Some(at) => (&raw[..at], &raw[at + 4..]),
        None => (raw, &[][..]),
    };
    let head = String::from_utf8_lossy(head);
    let code = head
        .lines()
        .next()
        .and_then(status_code)
        .ok_or("has no status")?;
    // A large answer (a network with many attachments) may come in chunks.
    let chunked = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("transfer-encoding")
                && value.trim().eq_ignore_ascii_case("chunked")
        })
    });
    let body = if chunked {
        dechunk(body).ok_or("has a broken chunked body")?
    } else {
        body.to_vec()
    };
    Ok(Answer {
        code,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
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
    use std::{os::unix::net::UnixListener, thread};

    use super::*;

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

    #[test]
    fn answers_are_parsed_and_errors_carry_the_agents_message() {
        let a =
            parse(b"HTTP/1.1 404 Not Found\r\nContent-Length: 20\r\n\r\n{\"error\":\"no VM x\"}")
                .unwrap();
        assert_eq!(a.code, 404);
        assert_eq!(a.success().unwrap_err().to_string(), "no VM x (HTTP 404)");
        let a = parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
            .unwrap();
        assert_eq!(a.success().unwrap(), "{}");
        assert_eq!(parse(b"garbage").unwrap_err(), "has no status");
    }

    #[test]
    fn a_request_goes_out_whole_and_its_answer_comes_back() {
        let dir = std::env::temp_dir().join(format!("vmpath-api-client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("api.sock");
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).unwrap();
        let server = thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut request = String::new();
            while !request.ends_with("\r\n\r\n") {
                if reader.read_line(&mut request).unwrap() == 0 {
                    break;
                }
            }
            let mut body = [0u8; 7];
            reader.read_exact(&mut body).unwrap();
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                .unwrap();
            (request, body)
        });
        let answer = Client::new(&socket)
            .request("POST", "/v1/endpoints", Some("{\"a\":1}"))
            .unwrap();
        assert_eq!((answer.code, answer.body.as_str()), (200, "{}"));
        let (head, body) = server.join().unwrap();
        assert!(
            head.starts_with("POST /v1/endpoints HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(head.contains("Content-Length: 7\r\n"), "{head}");
        assert_eq!(&body, b"{\"a\":1}");
        // Nobody listens any more: the error says so and names the socket.
        drop(std::fs::remove_file(&socket));
        let err = Client::new(&socket).get("/readyz").unwrap_err().to_string();
        assert!(
            err.contains("not reachable") && err.contains("agent not running"),
            "{err}"
        );
        assert!(err.contains(&socket.display().to_string()), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

//! The guest's command channel on its second serial port: the test writes
//! `<id> <command>\n`, the guest answers `@@begin <id>\n<output>\n@@end <id>
//! <exit status>\n`. Answers to earlier ids (a probe that was late) are
//! skipped.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::{Duration, Instant},
};

#[derive(Default)]
pub struct Channel {
    stream: Option<UnixStream>,
    buf: Vec<u8>,
    next_id: u64,
}

impl Channel {
    pub fn connect(path: &Path) -> Option<Channel> {
        let stream = UnixStream::connect(path).ok()?;
        Some(Channel {
            stream: Some(stream),
            buf: Vec::new(),
            next_id: 1,
        })
    }

    /// Sends a probe a second until the guest answers one (it drops what
    /// arrives before its init opened the port).
    pub fn wait_ready(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.request("true", Duration::from_secs(1)) {
                Ok(_) => return true,
                // QEMU is gone (the guest panicked with -no-reboot).
                Err(e) if e.contains("closed") => return false,
                Err(_) => {}
            }
        }
        false
    }

    /// Runs `cmd` in the guest: (exit status, output).
    pub fn request(&mut self, cmd: &str, timeout: Duration) -> Result<(i32, String), String> {
        self.request_paused(cmd, Duration::ZERO, timeout)
    }

    /// As [`Channel::request`], with the command line sent in two writes
    /// `pause` apart, so that the guest is half-way through reading it for
    /// that long (what a slow serial port does to a long line).
    pub fn request_paused(
        &mut self,
        cmd: &str,
        pause: Duration,
        timeout: Duration,
    ) -> Result<(i32, String), String> {
        assert!(!cmd.contains('\n'), "one line per command: {cmd:?}");
        let id = self.next_id;
        self.next_id += 1;
        let stream = self.stream.as_mut().ok_or("no channel")?;
        let line = format!("{id} {cmd}\n");
        let (head, tail) = line.split_at(if pause.is_zero() { 0 } else { line.len() / 2 });
        for (part, wait) in [(head, pause), (tail, Duration::ZERO)] {
            stream
                .write_all(part.as_bytes())
                .map_err(|e| format!("writing to the guest's channel: {e}"))?;
            std::thread::sleep(wait);
        }
        let begin = format!("@@begin {id}\n");
        let end = format!("\n@@end {id} ");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(at) = find(&self.buf, end.as_bytes()) {
                let rest = &self.buf[at + end.len()..];
                if let Some(nl) = rest.iter().position(|&b| b == b'\n') {
                    let rc: i32 = String::from_utf8_lossy(&rest[..nl])
                        .trim()
                        .parse()
                        .map_err(|_| "a garbled exit status".to_string())?;
                    let start = find(&self.buf, begin.as_bytes())
                        .map(|b| b + begin.len())
                        .filter(|&b| b <= at)
                        .ok_or("an answer without its beginning")?;
                    let out = String::from_utf8_lossy(&self.buf[start..at]).into_owned();
                    let consumed = at + end.len() + nl + 1;
                    self.buf.drain(..consumed);
                    return Ok((rc, out));
                }
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("no answer within {timeout:?}"));
            }
            let stream = self.stream.as_mut().unwrap();
            stream
                .set_read_timeout(Some(left.min(Duration::from_millis(200))))
                .unwrap();
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk) {
                Ok(0) => return Err("the channel closed (QEMU gone?)".into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => return Err(format!("reading the guest's channel: {e}")),
            }
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

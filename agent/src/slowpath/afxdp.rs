//! One AF_XDP socket and one UMEM on `vmp-slow1` (xdpilone): frames in from
//! the slow path's XDP program, replies out the same way.

use std::{ffi::CString, num::NonZeroU32, os::fd::RawFd, ptr::NonNull, time::Duration};

use anyhow::{Context as _, Result, anyhow};
use xdpilone::{
    BufIdx, DeviceQueue, IfInfo, RingRx, RingTx, Socket, SocketConfig, Umem, UmemConfig,
    xdp::XdpDesc,
};

const FRAME_SIZE: u32 = 4096;
/// Room for a burst of requests from every port at once (a node's VMs
/// all asking DHCP after it restarts).
const RX_FRAMES: u32 = 1024;
/// A copy-mode socket transmits each reply within `send`'s wake-up, so
/// its frame is back on the completion ring before the next reply: a
/// few frames would do. The UMEM is pinned resident memory (it was
/// 8 MiB with 1024 here; now 5 MiB).
const TX_FRAMES: u32 = 256;
const TOTAL_FRAMES: u32 = RX_FRAMES + TX_FRAMES;

/// Anonymous, page-aligned memory for the UMEM, unmapped on drop.
struct Area {
    ptr: NonNull<u8>,
    len: usize,
}

impl Area {
    fn new(len: usize) -> Result<Self> {
        // SAFETY: a fresh anonymous mapping (null hint, fd -1): it touches no memory
        // of ours; MAP_FAILED is checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error()).context("mmap for the UMEM");
        }
        Ok(Area {
            ptr: NonNull::new(ptr.cast()).ok_or_else(|| anyhow!("mmap returned null"))?,
            len,
        })
    }
}

impl Drop for Area {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly the mapping made in `Area::new`, unmapped only
        // here, once; the UMEM and rings over it are dropped first (field order).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

pub struct Xsk {
    // Field order is drop order: rings and socket before the memory.
    rx: RingRx,
    tx: RingTx,
    device: DeviceQueue,
    umem: Umem,
    free_tx: Vec<u64>,
    _area: Area,
}

// SAFETY: the socket, its rings and its memory are used by one thread at a
// time (the slow path thread, after set-up moves them there).
unsafe impl Send for Xsk {}

fn errno(e: xdpilone::Errno) -> anyhow::Error {
    anyhow!("{e}")
}

impl Xsk {
    /// Binds a socket to queue 0 of `ifname`.
    pub fn open(ifname: &str) -> Result<Self> {
        let area = Area::new((TOTAL_FRAMES * FRAME_SIZE) as usize)?;
        let slice = NonNull::slice_from_raw_parts(area.ptr, area.len);
        let config = UmemConfig {
            fill_size: RX_FRAMES,
            complete_size: TX_FRAMES,
            frame_size: FRAME_SIZE,
            headroom: 0,
            flags: 0,
        };
        // SAFETY: the area is page-aligned and outlives the UMEM (field order).
        let umem = unsafe { Umem::new(config, slice) }
            .map_err(errno)
            .context("creating the UMEM")?;
        let mut info = IfInfo::invalid();
        let name = CString::new(ifname)?;
        info.from_name(&name)
            .map_err(errno)
            .with_context(|| format!("interface {ifname}"))?;
        info.set_queue(0);
        let sock = Socket::with_shared(&info, &umem)
            .map_err(errno)
            .context("AF_XDP socket")?;
        let mut device = umem
            .fq_cq(&sock)
            .map_err(errno)
            .context("fill/completion rings")?;
        let rxtx = umem
            .rx_tx(
                &sock,
                &SocketConfig {
                    rx_size: NonZeroU32::new(RX_FRAMES),
                    tx_size: NonZeroU32::new(TX_FRAMES),
                    bind_flags: SocketConfig::XDP_BIND_NEED_WAKEUP,
                },
            )
            .map_err(errno)
            .context("rx/tx rings")?;
        let rx = rxtx.map_rx().map_err(errno)?;
        let tx = rxtx.map_tx().map_err(errno)?;
        umem.bind(&rxtx)
            .map_err(errno)
            .with_context(|| format!("binding to {ifname} queue 0"))?;
        {
            let mut fill = device.fill(RX_FRAMES);
            fill.insert((0..RX_FRAMES).map(|i| u64::from(i * FRAME_SIZE)));
            fill.commit();
        }
        Ok(Xsk {
            rx,
            tx,
            device,
            umem,
            free_tx: (RX_FRAMES..TOTAL_FRAMES)
                .map(|i| u64::from(i * FRAME_SIZE))
                .collect(),
            _area: area,
        })
    }

    /// The socket's fd, for the XSKMAP.
    pub fn fd(&self) -> RawFd {
        self.rx.as_raw_fd()
    }

    fn frame_bytes(&mut self, addr: u64) -> Option<&mut [u8]> {
        let chunk = self
            .umem
            .frame(BufIdx((addr / u64::from(FRAME_SIZE)) as u32))?;
        // SAFETY: one thread owns the socket; the kernel does not touch a
        // frame while userspace holds it.
        Some(unsafe { &mut *chunk.addr.as_ptr() })
    }

    /// Waits up to `timeout` for frames and calls `handle` on a batch of
    /// at most `max` of them (the rest wait in the ring for the next
    /// call); the replies it returns are sent.
    pub fn poll(
        &mut self,
        timeout: Duration,
        max: u32,
        handle: impl FnOnce(&[&[u8]]) -> Vec<Vec<u8>>,
    ) -> Result<()> {
        self.reap_completions();
        let mut pfd = libc::pollfd {
            fd: self.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: `pfd` is a live `pollfd` on our stack and the count is 1; the fd is
        // the socket `self` owns.
        let rc = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as i32) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                return Ok(());
            }
            return Err(e).context("poll on the AF_XDP socket");
        }
        let mut received: Vec<XdpDesc> = Vec::new();
        {
            let mut reader = self.rx.receive(max.min(RX_FRAMES));
            while let Some(desc) = reader.read() {
                received.push(desc);
            }
            reader.release();
        }
        let replies = {
            let mut frames: Vec<&[u8]> = Vec::with_capacity(received.len());
            for desc in &received {
                let base = desc.addr - desc.addr % u64::from(FRAME_SIZE);
                let Some(chunk) = self
                    .umem
                    .frame(BufIdx((base / u64::from(FRAME_SIZE)) as u32))
                else {
                    continue;
                };
                // SAFETY: one thread owns the socket; the kernel does not
                // touch a received frame until it is back on the fill ring.
                let frame: &[u8] = unsafe { &*chunk.addr.as_ptr() };
                let off = (desc.addr - base) as usize;
                let end = (off + desc.len as usize).min(frame.len());
                frames.push(&frame[off.min(end)..end]);
            }
            if frames.is_empty() {
                Vec::new()
            } else {
                handle(&frames)
            }
        };
        // Give the receive frames back to the kernel.
        if !received.is_empty() {
            let mut fill = self.device.fill(received.len() as u32);
            fill.insert(
                received
                    .iter()
                    .map(|d| d.addr - d.addr % u64::from(FRAME_SIZE)),
            );
            fill.commit();
        }
        for reply in replies {
            self.send(&reply)?;
        }
        Ok(())
    }

    /// Queues one frame for transmission.
    pub fn send(&mut self, frame: &[u8]) -> Result<()> {
        if frame.len() > FRAME_SIZE as usize {
            return Err(anyhow!(
                "reply of {} bytes does not fit a frame",
                frame.len()
            ));
        }
        self.reap_completions();
        let Some(addr) = self.free_tx.pop() else {
            return Err(anyhow!("no free transmit frame"));
        };
        let buf = self
            .frame_bytes(addr)
            .ok_or_else(|| anyhow!("bad frame address"))?;
        buf[..frame.len()].copy_from_slice(frame);
        let desc = XdpDesc {
            addr,
            len: frame.len() as u32,
            options: 0,
        };
        {
            let mut writer = self.tx.transmit(1);
            if !writer.insert_once(desc) {
                drop(writer);
                self.free_tx.push(addr);
                return Err(anyhow!("transmit ring full"));
            }
            writer.commit();
        }
        // Copy-mode sockets transmit on a syscall.
        self.tx.wake();
        Ok(())
    }

    fn reap_completions(&mut self) {
        let mut reader = self.device.complete(TX_FRAMES);
        while let Some(addr) = reader.read() {
            self.free_tx.push(addr - addr % u64::from(FRAME_SIZE));
        }
        reader.release();
    }
}

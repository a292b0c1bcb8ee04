//! The VM ports' tc filters as the kernel has them (rtnetlink): listed,
//! and removed. Attaching them is the data path's
//! (`apply::dataplane::port_filters`); this knows only their place on an
//! interface: `pref 1 handle 1`, kind `bpf`, at the clsact qdisc's
//! ingress and egress, named as one of `prog_names::PORT_PROGRAMS`.

use std::io;

use futures_util::TryStreamExt as _;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NetlinkMessage};
use rtnetlink::packet_route::{
    RouteNetlinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle as NlTcHandle, TcMessage, TcOption},
};
use vmpath_common::prog_names;

/// The filter priority (`tc filter show`: `pref 1`) of the port programs.
pub const PRIORITY: u16 = 1;
/// The filter handle at [`PRIORITY`].
pub const HANDLE: u32 = 1;

/// ETH_P_ALL, the protocol the filters match (network byte order in
/// `tcm_info`).
const ETH_P_ALL: u16 = 0x0003;

/// One of the port programs found attached to an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortFilter {
    pub ifindex: u32,
    pub ingress: bool,
    /// The program's name (one of `prog_names::PORT_PROGRAMS`).
    pub name: String,
    pub program_id: u32,
}

fn parent(ingress: bool) -> NlTcHandle {
    NlTcHandle {
        major: 0xffff,
        minor: if ingress {
            NlTcHandle::MIN_INGRESS
        } else {
            NlTcHandle::MIN_EGRESS
        },
    }
}

/// Removes the port filter at one hook of `ifindex`. `false`: there was
/// none (or the interface is gone).
pub fn detach(ifindex: u32, ingress: bool) -> io::Result<bool> {
    let mut msg = TcMessage::with_index(ifindex as i32);
    msg.header.parent = parent(ingress);
    msg.header.handle = HANDLE.into();
    msg.header.info = (u32::from(PRIORITY) << 16) | u32::from(ETH_P_ALL.to_be());
    msg.attributes.push(TcAttribute::Kind("bpf".into()));
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::DelTrafficFilter(msg));
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
    let result = crate::sys::netlink::run(|mut h| async move {
        let mut response = h.request(req)?;
        while let Some(m) = futures_util::StreamExt::next(&mut response).await {
            if let rtnetlink::packet_core::NetlinkPayload::Error(e) = m.payload
                && e.code.is_some()
            {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
        }
        Ok(())
    })?;
    match result {
        Ok(()) => Ok(true),
        Err(rtnetlink::Error::NetlinkError(e))
            if matches!(
                e.raw_code().abs(),
                libc::ENOENT | libc::ENODEV | libc::EINVAL
            ) =>
        {
            Ok(false)
        }
        Err(e) => Err(io::Error::other(format!(
            "removing the port filter of ifindex {ifindex}: {e}"
        ))),
    }
}

/// Removes both port filters of `ifindex`; whether any was there.
pub fn detach_port(ifindex: u32) -> io::Result<bool> {
    let ingress = detach(ifindex, true)?;
    let egress = detach(ifindex, false)?;
    Ok(ingress || egress)
}

/// The port programs attached to `ifindex` (filters at [`PRIORITY`] whose
/// program is named as one of `prog_names::PORT_PROGRAMS`).
pub fn list(ifindex: u32) -> io::Result<Vec<PortFilter>> {
    let mut out = Vec::new();
    for ingress in [true, false] {
        let mut msg = TcMessage::with_index(ifindex as i32);
        msg.header.parent = parent(ingress);
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetTrafficFilter(msg));
        req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let messages = crate::sys::netlink::run(|mut h| async move {
            let response = h.request(req)?;
            let mut found = Vec::new();
            futures_util::pin_mut!(response);
            while let Some(m) = futures_util::StreamExt::next(&mut response).await {
                match m.payload {
                    rtnetlink::packet_core::NetlinkPayload::InnerMessage(
                        RouteNetlinkMessage::NewTrafficFilter(f),
                    ) => found.push(f),
                    rtnetlink::packet_core::NetlinkPayload::Error(e) if e.code.is_some() => {
                        return Err(rtnetlink::Error::NetlinkError(e));
                    }
                    _ => {}
                }
            }
            Ok::<_, rtnetlink::Error>(found)
        })?;
        let messages = match messages {
            Ok(m) => m,
            // No clsact qdisc (or no such interface): nothing attached.
            Err(rtnetlink::Error::NetlinkError(e))
                if matches!(
                    e.raw_code().abs(),
                    libc::EINVAL | libc::ENODEV | libc::ENOENT
                ) =>
            {
                continue;
            }
            Err(e) => {
                return Err(io::Error::other(format!(
                    "listing the filters of ifindex {ifindex}: {e}"
                )));
            }
        };
        for f in messages {
            if f.header.info >> 16 != u32::from(PRIORITY) {
                continue;
            }
            let (mut name, mut program_id) = (None, None);
            for a in &f.attributes {
                if let TcAttribute::Options(options) = a {
                    for o in options {
                        match o {
                            TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => name = Some(n.clone()),
                            TcOption::Bpf(TcFilterBpfOption::ProgId(id)) => program_id = Some(*id),
                            _ => {}
                        }
                    }
                }
            }
            if let (Some(name), Some(program_id)) = (name, program_id)
                && prog_names::PORT_PROGRAMS.contains(&name.as_str())
            {
                out.push(PortFilter {
                    ifindex,
                    ingress,
                    name,
                    program_id,
                });
            }
        }
    }
    Ok(out)
}

/// The interfaces of this namespace that carry a port program.
pub fn ports_carrying() -> io::Result<std::collections::BTreeSet<u32>> {
    Ok(on_node()?.into_iter().map(|f| f.ifindex).collect())
}

/// Every port program attached in this namespace, by interface.
pub fn on_node() -> io::Result<Vec<PortFilter>> {
    let links = crate::sys::netlink::run(|h| async move {
        h.link()
            .get()
            .execute()
            .map_ok(|l| l.header.index)
            .try_collect::<Vec<u32>>()
            .await
    })?
    .map_err(|e| io::Error::other(format!("listing interfaces: {e}")))?;
    let mut out = Vec::new();
    for ifindex in links {
        out.extend(list(ifindex)?);
    }
    Ok(out)
}

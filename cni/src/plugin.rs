//! ADD, DEL, CHECK, STATUS and GC.

use std::{
    collections::HashSet,
    net::IpAddr,
    path::{Path, PathBuf},
};

use ipnet::IpNet;
use rscni_plugin::{
    cni::Cni,
    error::Error,
    types::{Args, CNIResult, Dns, Interface, IpConfig, NetConf, Route},
};
use serde_json::Value;
use vmpath_api::{
    Client, ClientError, DEFAULT_SOCKET,
    cni::{EndpointList, EndpointReply, EndpointRequest, host_ifname},
    path,
    types::{NetworkView, state},
};

use crate::link;
const DEFAULT_MTU: u32 = 1500;

// Error codes of our own (the spec leaves 100 and up to plugins).
const CODE_AGENT_REFUSED: u32 = 100;
const CODE_NOT_PROGRAMMED: u32 = 101;
const CODE_CHECK_FAILED: u32 = 102;

pub struct VmpathCni;

/// What the plugin's own config keys say.
struct Conf {
    network: String,
    socket: PathBuf,
}

impl Conf {
    fn of(conf: &NetConf) -> Result<Conf, Error> {
        let network = match conf.custom.get("network") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(other) => {
                return Err(Error::InvalidNetworkConfig(format!(
                    "\"network\" must be a non-empty string, not {other}"
                )));
            }
            None => {
                return Err(Error::InvalidNetworkConfig(
                    "\"network\" (the vmpath network's name) is missing".into(),
                ));
            }
        };
        let socket = match conf.custom.get("socket") {
            Some(Value::String(s)) if !s.is_empty() => PathBuf::from(s),
            None => PathBuf::from(DEFAULT_SOCKET),
            Some(other) => {
                return Err(Error::InvalidNetworkConfig(format!(
                    "\"socket\" must be a path, not {other}"
                )));
            }
        };
        Ok(Conf { network, socket })
    }
}

/// `CNI_ARGS`: `K=V;K=V`.
fn cni_arg<'a>(args: &'a Args, key: &str) -> Option<&'a str> {
    args.args()?
        .split(';')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
        .filter(|v| !v.is_empty())
}

/// `key` from runtimeConfig, then from `args.cni` (the conventions for a
/// requested MAC and similar).
fn conf_value<'a>(conf: &'a NetConf, key: &str) -> Option<&'a Value> {
    conf.runtime_config
        .as_ref()
        .and_then(|rc| rc.custom.get(key))
        .or_else(|| conf.args.as_ref()?.get("cni")?.get(key))
}

const VM_KEY: &str = "vmpath.dev/vm";

/// A virt-launcher pod: the VM behind it takes its addresses by DHCP.
fn is_vm(args: &Args) -> bool {
    let flag = |v: &Value| v.as_bool().unwrap_or(false) || v.as_str() == Some("true");
    cni_arg(args, VM_KEY) == Some("true")
        || conf_value(args.config(), VM_KEY).is_some_and(flag)
        || cni_arg(args, "K8S_POD_NAME").is_some_and(|n| n.starts_with("virt-launcher-"))
}

fn requested_mac(args: &Args) -> Option<String> {
    conf_value(args.config(), "mac")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| cni_arg(args, "MAC").map(str::to_string))
}

/// The identity parts every ADD, DEL and CHECK has.
struct Call {
    container_id: String,
    ifname: String,
    netns: Option<String>,
}

impl Call {
    fn of(args: &Args) -> Result<Call, Error> {
        let container_id = args
            .container_id()
            .map(|c| c.to_string())
            .ok_or_else(|| Error::missing_env(&["CNI_CONTAINERID"]))?;
        let ifname = args
            .ifname()
            .map(|i| i.to_string())
            .ok_or_else(|| Error::missing_env(&["CNI_IFNAME"]))?;
        Ok(Call {
            container_id,
            ifname,
            netns: args.netns().map(|p| p.display().to_string()),
        })
    }

    fn path(&self) -> String {
        path::endpoint(&self.container_id, &self.ifname)
    }
}

fn unreachable(e: ClientError) -> Error {
    Error::TryAgainLater(e.to_string())
}

fn get_network(socket: &Path, network: &str) -> Result<NetworkView, Error> {
    let answer = Client::new(socket)
        .get(&path::network_alone(network))
        .map_err(unreachable)?;
    match answer.code {
        200 => serde_json::from_str(&answer.body)
            .map_err(|e| Error::FailedToDecode(format!("the agent's network {network}: {e}"))),
        404 => Err(Error::InvalidNetworkConfig(format!(
            "vmpath has no network named {network:?} on this node"
        ))),
        _ => Err(Error::TryAgainLater(format!(
            "the agent answered {} for network {network}: {}",
            answer.code,
            answer.message()
        ))),
    }
}

fn gateway_for(ip: &IpNet, gateways: &[IpAddr]) -> Option<IpAddr> {
    gateways.iter().copied().find(|g| ip.contains(g))
}

/// The result: host and sandbox interfaces, the endpoint's IPs with their
/// gateway, a default route per family with a gateway. Appended to
/// `prev` (a chained plugin's result), as the spec asks.
/// The veth pair ADD made.
struct Made<'a> {
    host: &'a str,
    host_mac: Option<String>,
    ifname: &'a str,
    netns: &'a str,
    sandbox_mac: &'a str,
    mtu: u32,
}

fn build_result(
    prev: Option<CNIResult>,
    made: Made<'_>,
    reply: &EndpointReply,
) -> Result<CNIResult, Error> {
    let mut result = prev.unwrap_or_default();
    let base = result.interfaces.len() as u32;
    let Made {
        host,
        host_mac,
        ifname,
        netns,
        sandbox_mac,
        mtu,
    } = made;
    result.interfaces.push(Interface {
        name: host.to_string(),
        mac: host_mac.unwrap_or_default(),
        mtu: Some(mtu),
        sandbox: None,
        socket_path: None,
        pci_id: None,
    });
    result.interfaces.push(Interface {
        name: ifname.to_string(),
        mac: sandbox_mac.to_string(),
        mtu: Some(mtu),
        sandbox: Some(netns.to_string()),
        socket_path: None,
        pci_id: None,
    });
    if !reply.dns.nameservers.is_empty() || !reply.dns.search.is_empty() {
        result.dns = Some(Dns {
            nameservers: reply.dns.nameservers.clone(),
            domain: None,
            search: (!reply.dns.search.is_empty()).then(|| reply.dns.search.clone()),
            options: None,
        });
    }
    let gateways: Vec<IpAddr> = reply
        .gateways
        .iter()
        .filter_map(|g| g.parse().ok())
        .collect();
    for ip in &reply.ips {
        let address: IpNet = ip
            .parse()
            .map_err(|e| Error::FailedToDecode(format!("the agent's address {ip:?}: {e}")))?;
        let gateway = gateway_for(&address, &gateways);
        result.ips.push(IpConfig {
            interface: Some(base + 1),
            address,
            gateway,
        });
        if let Some(gw) = gateway {
            let dst: IpNet = if gw.is_ipv4() {
                "0.0.0.0/0".parse().unwrap_or(address)
            } else {
                "::/0".parse().unwrap_or(address)
            };
            if !result.routes.iter().any(|r| r.dst == dst) {
                result.routes.push(Route {
                    dst,
                    gw: Some(gw),
                    mtu: None,
                    advmss: None,
                    priority: None,
                    table: None,
                    scope: None,
                });
            }
        }
    }
    Ok(result)
}

/// Gives a plain pod its addresses and routes (those of the interface at
/// `base + 1` in `result`).
fn configure_pod(
    nl: &link::Netlink,
    index: u32,
    result: &CNIResult,
    base: usize,
) -> Result<(), String> {
    let addresses: Vec<IpNet> = result
        .ips
        .iter()
        .filter(|i| i.interface.map(|i| i as usize) == Some(base + 1))
        .map(|i| i.address)
        .collect();
    let routes: Vec<(IpNet, IpAddr)> = result
        .routes
        .iter()
        .filter_map(|r| Some((r.dst, r.gw?)))
        .collect();
    nl.configure_pod(index, &addresses, &routes)
}

fn netlink(netns: Option<&str>) -> Result<link::Netlink, Error> {
    link::Netlink::open(netns)
        .map_err(|e| Error::Custom(CODE_AGENT_REFUSED, "netlink is not available".into(), e))
}

/// The spec: a runtime must not ADD the same container and interface twice
/// without a DEL between. One that does (another sandbox, or the same) is
/// refused while the first one's port is there: replacing it would cut the
/// running sandbox off. A host side the agent does not know is a crashed
/// ADD's leftover, which `create_veth` replaces.
fn refuse_second_add(socket: &Path, call: &Call, nl: &link::Netlink) -> Result<(), Error> {
    let answer = Client::new(socket).get(&call.path()).map_err(unreachable)?;
    if answer.code != 200 {
        return Ok(());
    }
    let held: EndpointReply = serde_json::from_str(&answer.body)
        .map_err(|e| Error::FailedToDecode(format!("the agent's answer: {e}")))?;
    let port = &held.endpoint.port;
    if nl.host_link(port).ok().flatten().is_none() {
        return Ok(());
    }
    Err(Error::Custom(
        CODE_AGENT_REFUSED,
        "vmpath refused the endpoint".into(),
        format!(
            "container {} interface {} is attached already (sandbox {}, port {port}, network {:?}): \
             a second ADD without DEL is refused, the first sandbox keeps its port",
            call.container_id, call.ifname, held.endpoint.netns, held.endpoint.network
        ),
    ))
}

impl Cni for VmpathCni {
    fn add(&self, args: Args) -> Result<CNIResult, Error> {
        let conf = Conf::of(args.config())?;
        let call = Call::of(&args)?;
        let netns = call
            .netns
            .clone()
            .ok_or_else(|| Error::missing_env(&["CNI_NETNS"]))?;
        if !Path::new(&netns).exists() {
            return Err(Error::InvalidNetNS(format!("{netns} does not exist")));
        }
        let agent = Client::new(&conf.socket);
        let network = get_network(&conf.socket, &conf.network)?;
        let mtu = u32::from(network.mtu);
        let vm = is_vm(&args);
        let mac = requested_mac(&args);
        let host = host_ifname(&call.container_id, &call.ifname);
        let nl = netlink(Some(&netns))?;
        refuse_second_add(&conf.socket, &call, &nl)?;
        let pod_side = nl
            // A VM pod's interface only carries the VM's frames: its own
            // kernel stays silent (see `quiet_ipv6`).
            .create_veth(&host, &call.ifname, mac.as_deref(), mtu, vm)
            .map_err(|e| {
                Error::Custom(
                    CODE_AGENT_REFUSED,
                    "creating the veth pair failed".into(),
                    e,
                )
            })?;
        let undo = |e: Error| {
            let _ = agent.request("DELETE", &call.path(), None);
            let _ = nl.delete(&host);
            e
        };
        let sandbox_mac = pod_side.address.clone().unwrap_or_default();
        let request = EndpointRequest {
            container_id: call.container_id.clone(),
            ifname: call.ifname.clone(),
            netns: netns.clone(),
            network: conf.network.clone(),
            port: host.clone(),
            // A VM's MAC is its own, learned from its frames unless requested.
            mac: if vm {
                mac.clone()
            } else {
                Some(sandbox_mac.clone())
            },
            pod_namespace: cni_arg(&args, "K8S_POD_NAMESPACE")
                .unwrap_or("default")
                .to_string(),
            pod_name: cni_arg(&args, "K8S_POD_NAME")
                .map(str::to_string)
                .unwrap_or_else(|| {
                    format!(
                        "cni-{}",
                        &call.container_id[..call.container_id.len().min(12)]
                    )
                }),
            pod_uid: cni_arg(&args, "K8S_POD_UID").map(str::to_string),
            vm,
        };
        let body = serde_json::to_string(&request)
            .map_err(|e| undo(Error::FailedToDecode(e.to_string())))?;
        let answer = agent
            .request("POST", path::ENDPOINTS, Some(&body))
            .map_err(|e| undo(unreachable(e)))?;
        let reply: EndpointReply = match answer.code {
            200 => serde_json::from_str(&answer.body)
                .map_err(|e| undo(Error::FailedToDecode(format!("the agent's answer: {e}"))))?,
            404 => {
                return Err(undo(Error::InvalidNetworkConfig(answer.message())));
            }
            409 | 400 => {
                return Err(undo(Error::Custom(
                    CODE_AGENT_REFUSED,
                    "vmpath refused the endpoint".into(),
                    answer.message(),
                )));
            }
            503 => return Err(undo(Error::TryAgainLater(answer.message()))),
            _ => {
                return Err(undo(Error::Custom(
                    CODE_NOT_PROGRAMMED,
                    "vmpath did not program the port".into(),
                    answer.message(),
                )));
            }
        };
        let prev = args.config().prev_result.clone();
        let base = prev.as_ref().map_or(0, |p| p.interfaces.len());
        let host_mac = nl.host_link(&host).ok().flatten().and_then(|l| l.address);
        let result = build_result(
            prev,
            Made {
                host: &host,
                host_mac,
                ifname: &call.ifname,
                netns: &netns,
                sandbox_mac: &sandbox_mac,
                mtu,
            },
            &reply,
        )
        .map_err(undo)?;
        if !vm {
            configure_pod(&nl, pod_side.index, &result, base).map_err(|e| {
                undo(Error::Custom(
                    CODE_AGENT_REFUSED,
                    "configuring the pod's addresses failed".into(),
                    e,
                ))
            })?;
        }
        Ok(result)
    }

    fn del(&self, args: Args) -> Result<(), Error> {
        let conf = Conf::of(args.config())?;
        let call = Call::of(&args)?;
        // The port first: whatever the agent says, it must not outlive DEL.
        // The pod side goes with it (and with the netns, when that is gone).
        netlink(None)?
            .delete(&host_ifname(&call.container_id, &call.ifname))
            .map_err(|e| Error::Custom(CODE_AGENT_REFUSED, "deleting the port failed".into(), e))?;
        match Client::new(&conf.socket).request("DELETE", &call.path(), None) {
            Ok(a) if a.code == 200 || a.code == 404 => Ok(()),
            Ok(a) => Err(Error::TryAgainLater(format!(
                "the agent answered {} to DEL: {}",
                a.code,
                a.message()
            ))),
            // An agent that is down keeps nothing running for this port; its
            // entry goes at GC (the runtime repeats DEL or GC later).
            Err(_) => Ok(()),
        }
    }

    fn check(&self, args: Args) -> Result<(), Error> {
        let conf = Conf::of(args.config())?;
        let call = Call::of(&args)?;
        let fail =
            |what: String| Error::Custom(CODE_CHECK_FAILED, "vmpath CHECK failed".into(), what);
        let netns = call
            .netns
            .clone()
            .ok_or_else(|| Error::missing_env(&["CNI_NETNS"]))?;
        let answer = Client::new(&conf.socket)
            .get(&call.path())
            .map_err(unreachable)?;
        if answer.code != 200 {
            return Err(fail(format!(
                "the agent has no endpoint {}/{}: {}",
                call.container_id,
                call.ifname,
                answer.message()
            )));
        }
        let reply: EndpointReply = serde_json::from_str(&answer.body)
            .map_err(|e| Error::FailedToDecode(format!("the agent's answer: {e}")))?;
        if reply.endpoint.network != conf.network || reply.endpoint.netns != netns {
            return Err(fail(format!(
                "the agent's endpoint is on network {} in {}, the config says {} in {netns}",
                reply.endpoint.network, reply.endpoint.netns, conf.network
            )));
        }
        // A migration's source and target ports are programmed too.
        if ![state::LOCAL, state::MIGRATING, state::MIGRATION_TARGET]
            .contains(&reply.state.as_str())
        {
            return Err(fail(format!(
                "the port {} is {} in the agent",
                reply.endpoint.port, reply.state
            )));
        }
        let nl = link::Netlink::open(Some(&netns)).map_err(fail)?;
        let host = nl
            .host_link(&reply.endpoint.port)
            .map_err(fail)?
            .ok_or_else(|| fail(format!("the host side {} is missing", reply.endpoint.port)))?;
        let pod = nl
            .pod_link(&call.ifname)
            .map_err(fail)?
            .ok_or_else(|| fail(format!("{} is missing in {netns}", call.ifname)))?;
        let want_mtu = reply.mtu.map(u32::from).unwrap_or(DEFAULT_MTU);
        for l in [&host, &pod] {
            if l.mtu != Some(want_mtu) {
                return Err(fail(format!(
                    "{} has MTU {:?}, the network's is {want_mtu}",
                    l.ifname, l.mtu
                )));
            }
        }
        if !reply.endpoint.vm && reply.mac.is_some() && pod.address != reply.mac {
            return Err(fail(format!(
                "{} has MAC {:?}, the agent's entry {:?}",
                call.ifname, pod.address, reply.mac
            )));
        }
        // prevResult must list the interface this plugin made, as made.
        if let Some(prev) = &args.config().prev_result {
            let listed = prev
                .interfaces
                .iter()
                .find(|i| i.name == call.ifname && i.sandbox.as_deref() == Some(netns.as_str()));
            match listed {
                None => {
                    return Err(fail(format!(
                        "prevResult does not list {} in {netns}",
                        call.ifname
                    )));
                }
                Some(i) if Some(&i.mac) != pod.address.as_ref() => {
                    return Err(fail(format!(
                        "prevResult says {} has MAC {}, it has {:?}",
                        call.ifname, i.mac, pod.address
                    )));
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    fn status(&self, args: Args) -> Result<(), Error> {
        let conf = Conf::of(args.config())?;
        let answer = Client::new(&conf.socket)
            .get(path::READYZ)
            .map_err(|e| Error::PluginNotAvailable(e.to_string()))?;
        if answer.code != 200 {
            return Err(Error::PluginNotAvailable(format!(
                "the vmpath agent is not ready: {}",
                answer.message()
            )));
        }
        get_network(&conf.socket, &conf.network).map_err(|e| {
            Error::PluginNotAvailable(format!("network {}: {}", conf.network, e.details()))
        })?;
        Ok(())
    }

    fn gc(&self, args: Args) -> Result<(), Error> {
        let conf = Conf::of(args.config())?;
        let valid: HashSet<(String, String)> = args
            .config()
            .valid_attachments
            .iter()
            .flatten()
            .map(|a| (a.container_id.clone(), a.ifname.clone()))
            .collect();
        let agent = Client::new(&conf.socket);
        let answer = agent.get(path::ENDPOINTS).map_err(unreachable)?;
        // An agent that is starting has none to list yet: nothing to collect.
        if answer.code != 200 {
            return Ok(());
        }
        let list: EndpointList = serde_json::from_str(&answer.body)
            .map_err(|e| Error::FailedToDecode(format!("the agent's endpoints: {e}")))?;
        let nl = netlink(None)?;
        let mut failures = Vec::new();
        for EndpointReply { endpoint: e, .. } in list.endpoints {
            if e.network != conf.network
                || valid.contains(&(e.container_id.clone(), e.ifname.clone()))
            {
                continue;
            }
            if let Err(err) = nl.delete(&e.port) {
                failures.push(err);
                continue;
            }
            if let Err(err) =
                agent.request("DELETE", &path::endpoint(&e.container_id, &e.ifname), None)
            {
                failures.push(err.to_string());
            }
        }
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::TryAgainLater(failures.join("; ")))
        }
    }
}

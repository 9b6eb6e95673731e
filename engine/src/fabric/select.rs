//! Start-up of the fabric: join the cluster over TCP, agree on the configuration, and choose
//! verbs or TCP (`transport = auto | verbs | tcp`), saying which and why.

use std::sync::Arc;

use super::Fabric;
use super::tcp::TcpFabric;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};

/// Why a build without the `verbs` feature cannot use verbs.
#[cfg(not(feature = "verbs"))]
const NO_VERBS: &str = "this build of Ferry has no verbs support (the `verbs` cargo feature is off)";

/// The verbs device, port and GID a node would use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalVerbs {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// GID index.
    pub gid_index: u32,
    /// The port's link layer (InfiniBand or Ethernet).
    pub link_layer: String,
}

/// The verbs selection a node's configuration asks for.
#[cfg(feature = "verbs")]
pub fn selection(config: &Config) -> ferry_verbs::Selection {
    ferry_verbs::Selection { device: config.verbs.device_for(config.rank).map(str::to_string), port: config.verbs.port, gid_index: config.verbs.gid_index }
}

/// Whether this host could run the verbs fabric for `config`: the device, port and GID it
/// would use, or why not.
pub fn local_verbs(config: &Config) -> std::result::Result<LocalVerbs, String> {
    #[cfg(feature = "verbs")]
    {
        ferry_verbs::probe(&selection(config))
            .map(|c| LocalVerbs { device: c.device, port: c.port, gid_index: c.gid_index, link_layer: c.link_layer.to_string() })
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = config;
        Err(NO_VERBS.into())
    }
}

/// An opened verbs device (nothing, without the `verbs` feature).
#[cfg(feature = "verbs")]
type LocalContext = ferry_verbs::Context;
#[cfg(not(feature = "verbs"))]
type LocalContext = std::convert::Infallible;

fn open_local(config: &Config) -> std::result::Result<LocalContext, String> {
    #[cfg(feature = "verbs")]
    {
        ferry_verbs::Context::open(&selection(config)).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = config;
        Err(NO_VERBS.into())
    }
}

/// A cluster-wide decision about the transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Every node has verbs.
    Verbs,
    /// TCP, and why.
    Tcp(String),
}

/// Decides from every node's verbs status (`Err` holds the reason a node cannot use verbs).
pub fn decide(choice: TransportChoice, statuses: &[std::result::Result<(), String>]) -> Result<Decision> {
    if choice == TransportChoice::Tcp {
        return Ok(Decision::Tcp("transport = tcp was configured".into()));
    }
    if statuses.len() <= 1 && choice == TransportChoice::Auto {
        return Ok(Decision::Tcp("a single node needs no network transport".into()));
    }
    match statuses.iter().enumerate().find_map(|(r, s)| s.as_ref().err().map(|e| (r, e))) {
        None => Ok(Decision::Verbs),
        Some((r, reason)) if choice == TransportChoice::Verbs => Err(Error::Config(format!("transport = verbs, but node {r} cannot use verbs: {reason}"))),
        Some((r, reason)) => Ok(Decision::Tcp(format!("node {r} has no usable verbs: {reason}"))),
    }
}

fn encode_status<T>(status: &std::result::Result<T, String>) -> Vec<u8> {
    match status {
        Ok(_) => b"+".to_vec(),
        Err(reason) => [b"-".as_slice(), reason.as_bytes()].concat(),
    }
}

fn decode_status(blob: &[u8]) -> std::result::Result<(), String> {
    match blob.split_first() {
        Some((b'+', _)) => Ok(()),
        Some((b'-', reason)) => Err(String::from_utf8_lossy(reason).into_owned()),
        _ => Err("it sent a malformed verbs status".into()),
    }
}

/// Reader threads that may busy-poll per node over TCP with `config` when `nodes_on_host`
/// nodes share this host ([`Config::poll_cores`], or the machine's choice), and the cores the
/// choice counted.
pub fn busy_polling_readers(config: &Config, nodes_on_host: usize) -> (usize, usize) {
    let cores = ferry_tcp::cores();
    (config.poll_cores.unwrap_or_else(|| ferry_tcp::auto_poll_readers(cores, nodes_on_host)), cores)
}

/// Joins the cluster and builds the fabric; returns it with this node's clock offset to the
/// coordinator.
pub fn connect(config: &Config) -> Result<(Arc<dyn Fabric>, i64)> {
    let mesh_config = mesh_config(config);
    if config.membership.secret.is_none() && config.nodes > 1 && config.rank == 0 {
        tracing::warn!("no cluster secret (FERRY_NO_SECRET=1): any local user can join this cluster and read its parameters");
    }
    let (mut rendezvous, mesh) = ferry_tcp::join_cluster(config.rank, config.nodes, &config.coordinator, mesh_config)?;
    tracing::debug!(
        node = config.rank,
        poll_readers = mesh.poll_readers(),
        nodes_on_host = mesh.nodes_on_host(),
        cores = ferry_tcp::cores(),
        chosen = config.poll_cores.is_none(),
        "reader threads that may busy-poll"
    );
    let print = config.fingerprint_text().into_bytes();
    let prints = rendezvous.all_gather(&print, config.connect_timeout)?;
    if let Some(other) = prints.iter().position(|p| *p != print) {
        return Err(different_settings(config, other, &print, &prints[other]));
    }
    let clock_offset = rendezvous.clock_offset_ns(config.connect_timeout)?;
    // Every node reaches the same branch: the transport choice is part of the fingerprint.
    let wants_verbs = config.transport != TransportChoice::Tcp && config.nodes > 1;
    let local = if wants_verbs { open_local(config) } else { Err("not probed".into()) };
    let statuses: Vec<std::result::Result<(), String>> = if wants_verbs {
        rendezvous.all_gather(&encode_status(&local), config.connect_timeout)?.iter().map(|b| decode_status(b)).collect()
    } else {
        (0..config.nodes).map(|_| Err("not probed".into())).collect()
    };
    let decision = decide(config.transport, &statuses)?;
    let fabric: Arc<dyn Fabric> = match (decision, local) {
        #[cfg(feature = "verbs")]
        (Decision::Verbs, Ok(context)) => {
            let chosen = context.chosen().clone();
            let verbs = super::verbs::VerbsFabric::connect(
                &mut rendezvous,
                mesh,
                context,
                &config.verbs,
                max_frame(config),
                config.connect_timeout,
                config.fail_sends_after,
            )?;
            tracing::info!(
                node = config.rank,
                nodes = config.nodes,
                device = %chosen.device,
                port = chosen.port,
                gid_index = chosen.gid_index,
                link_layer = %chosen.link_layer,
                "transport selected: verbs (every node has an active verbs port)"
            );
            Arc::new(verbs)
        }
        #[cfg(not(feature = "verbs"))]
        (Decision::Verbs, Ok(never)) => match never {},
        (Decision::Verbs, Err(reason)) => return Err(Error::Transport(format!("verbs were chosen but this node cannot use them: {reason}"))),
        (Decision::Tcp(why), _) => {
            tracing::info!(node = config.rank, nodes = config.nodes, "transport selected: tcp ({why})");
            Arc::new(TcpFabric::new(mesh))
        }
    };
    Ok((fabric, clock_offset))
}

/// The error for node `other`, whose fingerprint `theirs` differs from this node's `ours`.
fn different_settings(config: &Config, other: usize, ours: &[u8], theirs: &[u8]) -> Error {
    Error::Config(format!(
        "node {other} was started with different tables or settings than node {}: {}",
        config.rank,
        Config::first_difference(&String::from_utf8_lossy(ours), &String::from_utf8_lossy(theirs))
    ))
}

/// What a member hands a joining node (see [`join`]): the fabric the cluster runs, and its
/// configuration fingerprint.
pub fn join_info(fabric: &str, config: &Config) -> Vec<u8> {
    format!("{fabric}\n{}", config.fingerprint_text()).into_bytes()
}

/// The fabric and fingerprint of a member's join information.
fn split_join_info(info: &[u8]) -> Result<(&str, &[u8])> {
    let at = info.iter().position(|&b| b == b'\n').ok_or_else(|| Error::Transport("the contact sent malformed join information".into()))?;
    let fabric = std::str::from_utf8(&info[..at]).map_err(|_| Error::Transport("the contact sent malformed join information".into()))?;
    Ok((fabric, &info[at + 1..]))
}

/// Joins a running cluster through `contact` (a member's join address) in the rank of a node
/// that left or was lost, over the fabric the cluster runs (TCP, or verbs with a queue pair per
/// member traded through the door); returns the fabric (not started) and the rank to ask to
/// join, the lowest-ranked member reached (it coordinates).
pub fn join(config: &Config, contact: &str) -> Result<(Arc<dyn Fabric>, u16)> {
    let print = config.fingerprint_text().into_bytes();
    // Set up once the contact said which fabric the cluster runs.
    let mut verbs: Option<VerbsJoin> = None;
    let mut offer = |info: &[u8], member: usize| -> std::result::Result<Vec<u8>, String> {
        let (fabric, theirs) = split_join_info(info).map_err(|e| e.to_string())?;
        if theirs != print {
            return Err(different_settings(config, member, &print, theirs).to_string());
        }
        match fabric {
            "tcp" => Ok(Vec::new()),
            "verbs" => {
                if verbs.is_none() {
                    verbs = Some(VerbsJoin::open(config)?);
                }
                verbs.as_mut().expect("opened").offer(member)
            }
            other => Err(format!("the cluster runs a fabric this node does not know: {other}")),
        }
    };
    let joined = ferry_tcp::join_running(config.rank, config.nodes, contact, mesh_config(config), &mut offer)?;
    let (fabric, theirs) = split_join_info(&joined.info)?;
    if theirs != print {
        return Err(different_settings(config, joined.contact, &print, theirs));
    }
    let coordinator = joined.members.iter().copied().min().unwrap_or(joined.contact);
    tracing::info!(node = config.rank, contact = joined.contact, members = ?joined.members, "connected to the running cluster: transport {fabric}");
    let fabric: Arc<dyn Fabric> = match verbs {
        Some(verbs) => verbs.finish(config, joined.mesh, &joined.answers)?,
        None => Arc::new(TcpFabric::new(joined.mesh)),
    };
    Ok((fabric, coordinator as u16))
}

/// A joining node's verbs connections (see `verbs::JoiningVerbs`).
#[cfg(feature = "verbs")]
struct VerbsJoin(super::verbs::JoiningVerbs);
#[cfg(not(feature = "verbs"))]
struct VerbsJoin(std::convert::Infallible);

impl VerbsJoin {
    fn open(config: &Config) -> std::result::Result<VerbsJoin, String> {
        if config.transport == TransportChoice::Tcp {
            return Err("the cluster runs over verbs and this node was started for TCP (FERRY_TRANSPORT=tcp)".into());
        }
        let context = open_local(config).map_err(|e| format!("the cluster runs over verbs and this node cannot use them: {e}"))?;
        #[cfg(feature = "verbs")]
        {
            super::verbs::JoiningVerbs::open(context, &config.verbs, config.rank, config.nodes).map(VerbsJoin).map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "verbs"))]
        match context {}
    }

    fn offer(&mut self, member: usize) -> std::result::Result<Vec<u8>, String> {
        #[cfg(feature = "verbs")]
        {
            self.0.offer(member).map_err(|e| e.to_string())
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = member;
            match self.0 {}
        }
    }

    fn finish(self, config: &Config, control: ferry_tcp::Mesh, answers: &[Vec<u8>]) -> Result<Arc<dyn Fabric>> {
        #[cfg(feature = "verbs")]
        {
            Ok(Arc::new(self.0.finish(control, answers, max_frame(config), config.verbs.poll_spin)?))
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = (config, control, answers);
            match self.0 {}
        }
    }
}

fn mesh_config(config: &Config) -> ferry_tcp::MeshConfig {
    ferry_tcp::MeshConfig {
        max_frame: max_frame(config),
        heartbeat: config.heartbeat,
        peer_timeout: config.peer_timeout,
        connect_timeout: config.connect_timeout,
        send_queue_limit: config.send_queue_limit,
        fail_sends_after: config.fail_sends_after,
        stop_reading_after: config.stop_reading_after,
        membership: config.membership.clone(),
        poll_readers: config.poll_cores,
        ..Default::default()
    }
}

fn max_frame(config: &Config) -> usize {
    (config.max_message_bytes * 4).max(64 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_needs_every_node() {
        let ok = || Ok(());
        let no = |m: &str| Err(m.to_string());
        assert_eq!(decide(TransportChoice::Auto, &[ok(), ok()]).unwrap(), Decision::Verbs);
        assert_eq!(decide(TransportChoice::Auto, &[ok(), no("ENOSYS")]).unwrap(), Decision::Tcp("node 1 has no usable verbs: ENOSYS".into()));
        assert!(matches!(decide(TransportChoice::Auto, &[ok()]).unwrap(), Decision::Tcp(_)), "a single node uses no network");
        let e = decide(TransportChoice::Verbs, &[no("no device"), ok()]).unwrap_err();
        assert!(e.to_string().contains("node 0 cannot use verbs: no device"), "{e}");
        assert!(matches!(decide(TransportChoice::Tcp, &[ok(), ok()]).unwrap(), Decision::Tcp(_)));
    }

    #[test]
    fn join_information_names_the_fabric_and_the_fingerprint() {
        let config = Config::new(vec![crate::TableSpec::new("t", 10, 2)]);
        let info = join_info("verbs", &config);
        let (fabric, print) = split_join_info(&info).unwrap();
        assert_eq!((fabric, print), ("verbs", config.fingerprint_text().as_bytes()));
        assert!(split_join_info(b"no line").is_err());
    }

    #[test]
    fn statuses_round_trip() {
        assert_eq!(decode_status(&encode_status::<()>(&Err("why".into()))), Err("why".into()));
        assert_eq!(decode_status(b"+"), Ok(()));
        assert!(decode_status(b"").is_err());
        assert!(decode_status(b"?x").is_err());
    }
}

//! Device and port discovery: what `ferry info` prints and what transport selection asks.

use std::net::Ipv6Addr;

use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo as _, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;

use crate::error::{Result, VerbsError};

/// A port's link layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID, GRH optional.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, GRH required.
    Ethernet,
    /// The driver did not say (old InfiniBand drivers).
    Unspecified,
}

impl std::fmt::Display for LinkLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet (RoCE)",
            LinkLayer::Unspecified => "unspecified",
        })
    }
}

/// What kind of address a GID is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidKind {
    /// An InfiniBand GID.
    InfiniBand,
    /// RoCE v1 (Ethernet frames, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable).
    RoceV2,
}

impl std::fmt::Display for GidKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GidKind::InfiniBand => "IB",
            GidKind::RoceV1 => "RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
        })
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidInfo {
    /// Index in the table (what `gid_index` settings name).
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// Its kind.
    pub kind: GidKind,
}

impl GidInfo {
    /// The GID as an IPv6 address (RoCE GIDs are IP addresses; IPv4 ones are `::ffff:a.b.c.d`).
    pub fn address(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.gid)
    }
}

/// A port of a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Port number (from 1).
    pub port: u8,
    /// Whether the logical link is active.
    pub active: bool,
    /// The logical state in words.
    pub state: String,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// Active MTU in bytes.
    pub active_mtu: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Non-empty GID table entries.
    pub gids: Vec<GidInfo>,
}

/// A verbs device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Its ports.
    pub ports: Vec<PortInfo>,
}

/// Which device, port and GID to use; `None` picks automatically.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Device name.
    pub device: Option<String>,
    /// Port number.
    pub port: Option<u8>,
    /// GID index.
    pub gid_index: Option<u32>,
}

/// The device, port and GID a [`Selection`] resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chosen {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u8,
    /// GID index.
    pub gid_index: u32,
    /// The port's link layer.
    pub link_layer: LinkLayer,
}

/// `IBV_PORT_ACTIVE` of `enum ibv_port_state`.
const PORT_ACTIVE: u32 = 4;

fn port_state_name(state: u32) -> &'static str {
    match state {
        1 => "down",
        2 => "initializing",
        3 => "armed",
        4 => "active",
        5 => "active (deferred)",
        _ => "unknown",
    }
}

pub(crate) fn mtu_bytes(raw: u32) -> u32 {
    // `enum ibv_mtu`: 1 = 256 … 5 = 4096.
    if (1..=5).contains(&raw) { 128 << raw } else { 0 }
}

/// Opens the device list, turning its failure into a reason a user can act on.
pub(crate) fn device_list() -> Result<DeviceList> {
    match DeviceList::new() {
        Ok(list) => Ok(list),
        Err(e) => {
            let os = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<std::io::Error>()).and_then(|io| io.raw_os_error());
            let errno = os.or_else(|| std::io::Error::last_os_error().raw_os_error());
            Err(VerbsError::Unavailable(match errno {
                Some(libc::EOPNOTSUPP) => "libibverbs.so.1 could not be loaded (install libibverbs1 and ibverbs-providers)".into(),
                Some(libc::ENOSYS) => "the kernel has no RDMA verbs support (ibv_get_device_list: ENOSYS; ib_uverbs is not available)".into(),
                Some(code) => format!("listing verbs devices failed: {}", std::io::Error::from_raw_os_error(code)),
                None => format!("listing verbs devices failed: {e}"),
            }))
        }
    }
}

fn port_info(ctx: &DeviceContext, port: u8) -> Result<PortInfo> {
    let attr = ctx.query_port(port).map_err(|e| VerbsError::Resource { what: "querying a port", reason: e.to_string() })?;
    // Raw fields rather than sideway's enum conversions, which panic on values they do not know.
    let raw = &attr.attr;
    let state = raw.state;
    let link_layer = match raw.link_layer {
        1 => LinkLayer::InfiniBand,
        2 => LinkLayer::Ethernet,
        _ => LinkLayer::Unspecified,
    };
    let mut gids = Vec::new();
    for index in 0..attr.gid_tbl_len().max(0) as u32 {
        let Ok(entry) = ctx.query_gid_ex(port, index) else { continue };
        let gid = entry.gid();
        if gid.is_zero() {
            continue;
        }
        let kind = match entry.gid_type() {
            GidType::InfiniBand => GidKind::InfiniBand,
            GidType::RoceV1 => GidKind::RoceV1,
            GidType::RoceV2 => GidKind::RoceV2,
        };
        gids.push(GidInfo { index, gid: gid.raw, kind });
    }
    Ok(PortInfo {
        port,
        active: state == PORT_ACTIVE,
        state: port_state_name(state).into(),
        link_layer,
        active_mtu: mtu_bytes(raw.active_mtu),
        lid: raw.lid,
        gids,
    })
}

pub(crate) fn describe(ctx: &DeviceContext, name: String) -> Result<DeviceInfo> {
    let device = ctx.query_device().map_err(|e| VerbsError::Resource { what: "querying a device", reason: e.to_string() })?;
    let ports = (1..=device.phys_port_cnt()).map(|p| port_info(ctx, p)).collect::<Result<Vec<_>>>()?;
    Ok(DeviceInfo { name, ports })
}

/// Lists the verbs devices with their ports and GIDs. Fails with [`VerbsError::Unavailable`]
/// when libibverbs is missing or the kernel has no RDMA support.
pub fn list_devices() -> Result<Vec<DeviceInfo>> {
    let list = device_list()?;
    let mut out = Vec::new();
    for device in list.iter() {
        let name = device.name();
        let ctx = device.open().map_err(|e| VerbsError::Resource { what: "opening a device", reason: format!("{name}: {e}") })?;
        out.push(describe(&ctx, name)?);
    }
    Ok(out)
}

/// The GID index to use on a port when none is configured: on InfiniBand the port GID (index 0);
/// on RoCE a RoCE v2 GID, preferring an IPv4-mapped one (routable between hosts), then any
/// other non-link-local, then a link-local one.
pub fn default_gid_index(port: &PortInfo) -> Option<u32> {
    if port.link_layer != LinkLayer::Ethernet {
        return port.gids.first().map(|g| g.index);
    }
    let v2 = || port.gids.iter().filter(|g| g.kind == GidKind::RoceV2);
    let ipv4_mapped = |g: &&GidInfo| g.address().to_ipv4_mapped().is_some();
    let link_local = |g: &&GidInfo| g.gid[0] == 0xfe && g.gid[1] & 0xc0 == 0x80;
    v2().find(ipv4_mapped).or_else(|| v2().find(|g| !link_local(g))).or_else(|| v2().next()).or_else(|| port.gids.first()).map(|g| g.index)
}

/// Resolves a selection against the devices: the named (or first) device with an active port,
/// and the configured (or default) GID on it.
pub fn choose(devices: &[DeviceInfo], selection: &Selection) -> Result<Chosen> {
    if devices.is_empty() {
        return Err(VerbsError::Unavailable(
            "no verbs devices (load an RDMA driver, or create soft-RoCE with 'rdma link add rxe0 type rxe netdev <if>')".into(),
        ));
    }
    let candidates: Vec<&DeviceInfo> = match &selection.device {
        Some(name) => match devices.iter().find(|d| &d.name == name) {
            Some(d) => vec![d],
            None => {
                return Err(VerbsError::NoSuchDevice { name: name.clone(), available: devices.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ") });
            }
        },
        None => devices.iter().collect(),
    };
    for device in &candidates {
        for port in &device.ports {
            if !port.active || selection.port.is_some_and(|p| p != port.port) {
                continue;
            }
            let gid_index = match selection.gid_index {
                Some(index) => {
                    if port.link_layer == LinkLayer::Ethernet && !port.gids.iter().any(|g| g.index == index) {
                        return Err(VerbsError::Invalid(format!("{} port {} has no GID at index {index}", device.name, port.port)));
                    }
                    index
                }
                None => match default_gid_index(port) {
                    Some(i) => i,
                    None if port.link_layer == LinkLayer::Ethernet => continue,
                    None => 0,
                },
            };
            return Ok(Chosen { device: device.name.clone(), port: port.port, gid_index, link_layer: port.link_layer });
        }
    }
    let names = candidates.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ");
    Err(VerbsError::Unavailable(match selection.port {
        Some(p) => format!("port {p} of {names} is not active"),
        None => format!("no active port on {names}"),
    }))
}

/// Whether this host has a usable verbs port for `selection`; `Err` says why not.
pub fn probe(selection: &Selection) -> Result<Chosen> {
    choose(&list_devices()?, selection)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(link_layer: LinkLayer, gids: &[(u32, &str, GidKind)], active: bool) -> PortInfo {
        PortInfo {
            port: 1,
            active,
            state: if active { "Active".into() } else { "Down".into() },
            link_layer,
            active_mtu: 1024,
            lid: 0,
            gids: gids.iter().map(|(i, a, k)| GidInfo { index: *i, gid: a.parse::<Ipv6Addr>().unwrap().octets(), kind: *k }).collect(),
        }
    }

    #[test]
    fn default_gid_prefers_routable_roce_v2() {
        let p = port(
            LinkLayer::Ethernet,
            &[
                (0, "fe80::1", GidKind::RoceV2),
                (1, "fe80::1", GidKind::RoceV1),
                (2, "::ffff:10.0.0.1", GidKind::RoceV1),
                (3, "::ffff:10.0.0.1", GidKind::RoceV2),
            ],
            true,
        );
        assert_eq!(default_gid_index(&p), Some(3));
        let p = port(LinkLayer::Ethernet, &[(0, "fe80::1", GidKind::RoceV2), (1, "fe80::1", GidKind::RoceV1)], true);
        assert_eq!(default_gid_index(&p), Some(0));
        let p = port(LinkLayer::InfiniBand, &[(0, "fe80::2", GidKind::InfiniBand)], true);
        assert_eq!(default_gid_index(&p), Some(0));
    }

    #[test]
    fn choose_reports_why_nothing_fits() {
        let devices = vec![
            DeviceInfo { name: "rxe0".into(), ports: vec![port(LinkLayer::Ethernet, &[(0, "fe80::1", GidKind::RoceV2)], false)] },
            DeviceInfo { name: "rxe1".into(), ports: vec![port(LinkLayer::Ethernet, &[(0, "fe80::2", GidKind::RoceV2)], true)] },
        ];
        assert!(matches!(choose(&[], &Selection::default()), Err(VerbsError::Unavailable(_))));
        let chosen = choose(&devices, &Selection::default()).unwrap();
        assert_eq!((chosen.device.as_str(), chosen.port, chosen.gid_index), ("rxe1", 1, 0));
        let err = choose(&devices, &Selection { device: Some("rxe0".into()), ..Default::default() }).unwrap_err();
        assert!(matches!(&err, VerbsError::Unavailable(m) if m.contains("no active port on rxe0")), "{err}");
        let err = choose(&devices, &Selection { device: Some("mlx5_0".into()), ..Default::default() }).unwrap_err();
        assert!(matches!(&err, VerbsError::NoSuchDevice { available, .. } if available == "rxe0, rxe1"), "{err}");
        let err = choose(&devices, &Selection { gid_index: Some(7), ..Default::default() }).unwrap_err();
        assert!(matches!(err, VerbsError::Invalid(_)));
    }

    #[test]
    fn mtu_codes() {
        assert_eq!(mtu_bytes(1), 256);
        assert_eq!(mtu_bytes(3), 1024);
        assert_eq!(mtu_bytes(5), 4096);
        assert_eq!(mtu_bytes(9), 0);
    }
}

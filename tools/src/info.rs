//! `ferry info`: what this host offers Ferry.

use anyhow::Result;

fn read(path: &str) -> Option<String> {
    std::fs::read_to_string(path).ok().map(|s| s.trim().to_string())
}

fn memlock() -> String {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `limit` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return "unknown".into();
    }
    let fmt = |v: libc::rlim_t| if v == libc::RLIM_INFINITY { "unlimited".to_string() } else { format!("{} KiB", v / 1024) };
    format!("{} (hard {})", fmt(limit.rlim_cur), fmt(limit.rlim_max))
}

/// Prints the host report.
pub fn print() -> Result<()> {
    println!("Ferry {}", env!("CARGO_PKG_VERSION"));
    println!("memlock limit:       {}", memlock());
    let total = read("/proc/sys/vm/nr_hugepages").unwrap_or_else(|| "?".into());
    let free = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().find(|l| l.starts_with("HugePages_Free")).map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_string()))
        .unwrap_or_else(|| "?".into());
    println!("huge pages (2 MiB):  {total} configured, {free} free");
    println!("transparent huge pages: {}", read("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_else(|| "unavailable".into()));
    let mut config = ferry::Config::new(vec![ferry::TableSpec::new("info", 1, 1)]);
    config.apply_transport_env(|k| std::env::var(k).ok())?;
    match ferry_verbs::list_devices() {
        Err(e) => println!("verbs devices:       none ({e})"),
        Ok(devices) if devices.is_empty() => println!("verbs devices:       none"),
        Ok(devices) => {
            println!("verbs devices:");
            for d in &devices {
                for p in &d.ports {
                    println!("  {} port {}: {}, {}, MTU {}, LID {}", d.name, p.port, p.state, p.link_layer, p.active_mtu, p.lid);
                    for g in &p.gids {
                        println!("    GID {:>2}  {:<40} {}", g.index, g.address(), g.kind);
                    }
                }
            }
        }
    }
    let ((alone, cores), (shared, _)) = (ferry::busy_polling_readers(&config, 1), ferry::busy_polling_readers(&config, 2));
    let source = if config.poll_cores.is_some() { "FERRY_POLL_CORES" } else { "auto: one when every node on the host has 4 cores" };
    println!("busy-polling readers: {alone} per node with the host to itself, {shared} with two nodes on it ({cores} cores; {source})");
    match config.transport {
        ferry::TransportChoice::Tcp => println!("transport:           tcp (FERRY_TRANSPORT=tcp)"),
        choice => match ferry::local_verbs(&config) {
            Ok(c) => println!(
                "transport {choice} picks: verbs on {} port {} GID index {} ({}), provided every node has verbs",
                c.device, c.port, c.gid_index, c.link_layer
            ),
            Err(reason) if choice == ferry::TransportChoice::Verbs => println!("transport verbs:     would fail here: {reason}"),
            Err(reason) => println!("transport auto picks: tcp ({reason})"),
        },
    }
    Ok(())
}

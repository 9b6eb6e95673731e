//! Every node's statistics for Prometheus (`Config::metrics`, `FERRY_METRICS`): scraped over
//! HTTP from a 2-node cluster in this process, and from a training run's two processes while
//! they train.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferry::{Config, Node, TableSpec};
use ferry_tests::{binary, finalize_all};

/// `GET /metrics` from `address`: the body, if the node answered 200.
fn scrape(address: SocketAddr) -> Option<String> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n").ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    (head.split(' ').nth(1) == Some("200")).then(|| body.to_string())
}

/// The value of the sample line that starts with `series` (name and labels).
fn value(metrics: &str, series: &str) -> f64 {
    let line = metrics.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' ')).unwrap_or_else(|| panic!("no {series} in:\n{metrics}"));
    line[series.len()..].trim().parse().unwrap()
}

#[test]
fn every_node_serves_its_counters() {
    let mut config = Config::new(vec![TableSpec::new("t", 100, 4)]);
    config.metrics = Some("127.0.0.1:0".into());
    let cluster = Node::start_local_cluster(2, config).unwrap();
    let table = cluster[0].table("t").unwrap();
    let mut worker = cluster[0].worker();
    let keys: Vec<u64> = (0..100).collect();
    worker.push(table, &keys, &vec![1.0; 400]).unwrap();
    let mut out = vec![0.0; 400];
    worker.pull(table, &keys, &mut out).unwrap();
    // Node 1's keys moved here: relocation and blocking times (a pull after the localize
    // waits for the keys to land).
    worker.localize(table, &keys[50..]).unwrap();
    worker.pull(table, &keys[50..], &mut out[200..]).unwrap();
    drop(worker);
    let metrics = scrape(cluster[0].metrics_address().expect("node 0 serves metrics")).expect("node 0 answers");
    assert!(metrics.ends_with("# EOF\n"), "OpenMetrics text:\n{metrics}");
    assert_eq!(value(&metrics, "ferry_nodes"), 2.0);
    assert_eq!(value(&metrics, "ferry_rank"), 0.0);
    // Half the keys are node 1's: both kinds of access, and messages to it.
    let (local, remote) = (value(&metrics, "ferry_key_accesses_total{served=\"local\"}"), value(&metrics, "ferry_key_accesses_total{served=\"remote\"}"));
    assert!(local >= 100.0 && remote >= 100.0, "{local} local, {remote} remote");
    assert!(value(&metrics, "ferry_messages_sent_total{kind=\"access\"}") > 0.0);
    assert!(value(&metrics, "ferry_bytes_received_total") > 0.0, "the node received nothing?");
    let share = value(&metrics, "ferry_local_share");
    assert!((share - local / (local + remote)).abs() < 1e-9);
    assert_eq!(value(&metrics, "ferry_peers_lost"), 0.0);
    assert!(value(&metrics, "ferry_send_queue_bytes{peer=\"1\"}") >= 0.0);
    assert!(!metrics.contains("ferry_send_queue_bytes{peer=\"0\"}"), "no queue to itself");
    // Latencies as histograms: cumulative buckets up to +Inf, which is the count (the 50 keys
    // that moved here), and a sum that the largest sample bounds.
    let count = value(&metrics, "ferry_relocation_latency_seconds_count");
    assert_eq!(count, 50.0, "{metrics}");
    let buckets: Vec<f64> =
        metrics.lines().filter(|l| l.starts_with("ferry_relocation_latency_seconds_bucket{")).map(|l| l.rsplit(' ').next().unwrap().parse().unwrap()).collect();
    assert_eq!(buckets.len(), ferry::LATENCY_BUCKET_BOUNDS_NS.len() + 1, "{metrics}");
    assert!(buckets.windows(2).all(|w| w[0] <= w[1]), "cumulative buckets: {buckets:?}");
    assert_eq!(value(&metrics, "ferry_relocation_latency_seconds_bucket{le=\"+Inf\"}"), count);
    let (sum, largest) =
        (value(&metrics, "ferry_relocation_latency_seconds_sum"), value(&metrics, "ferry_relocation_latency_quantile_seconds{quantile=\"1\"}"));
    assert!(sum > 0.0 && sum <= count * largest * 1.01, "sum {sum}, largest {largest}");
    assert!(value(&metrics, "ferry_blocking_latency_seconds_count") > 0.0, "{metrics}");
    let other = scrape(cluster[1].metrics_address().unwrap()).unwrap();
    assert_eq!(value(&other, "ferry_rank"), 1.0);
    // Anything but /metrics is not found.
    let mut stream = TcpStream::connect(cluster[0].metrics_address().unwrap()).unwrap();
    write!(stream, "GET /other HTTP/1.0\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert_eq!(response.split(' ').nth(1), Some("404"), "{response}");
    let address = cluster[0].metrics_address().unwrap();
    finalize_all(cluster);
    assert!(scrape(address).is_none(), "a finalized node stops serving");
}

#[test]
fn a_training_run_serves_metrics_from_each_process_while_it_trains() {
    // Rank r serves on base + r: a base whose neighbour another process holds makes rank 1 fail
    // to start, so a run that ends before both served is tried again on another base.
    let mut attempt = 0;
    let (base, seen) = loop {
        attempt += 1;
        let base = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut run = Command::new(binary("ferry"))
            .args(["train", "mf", "--data", "synth-tiny", "--rank", "4", "--mode", "localize", "--nodes", "2", "--epochs", "400", "--json"])
            .env("FERRY_METRICS", format!("127.0.0.1:{base}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let started = Instant::now();
        let mut seen = [None, None];
        while seen.iter().any(Option::is_none) && started.elapsed() < Duration::from_secs(120) && run.try_wait().unwrap().is_none() {
            for (rank, slot) in seen.iter_mut().enumerate() {
                if slot.is_none() {
                    *slot =
                        scrape(SocketAddr::from(([127, 0, 0, 1], base + rank as u16))).filter(|m| value(m, "ferry_key_accesses_total{served=\"local\"}") > 0.0);
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let ended_early = run.try_wait().unwrap().is_some();
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", run.id())]).status();
        let output = run.wait_with_output().unwrap();
        if seen.iter().all(Option::is_some) || !ended_early || attempt == 3 {
            if seen.iter().any(Option::is_none) {
                eprintln!("the run's errors:\n{}", String::from_utf8_lossy(&output.stderr));
            }
            break (base, seen);
        }
    };
    for (rank, metrics) in seen.iter().enumerate() {
        let metrics = metrics.as_ref().unwrap_or_else(|| panic!("rank {rank} never served metrics with accesses on port {}", base + rank as u16));
        assert_eq!(value(metrics, "ferry_rank"), rank as f64);
        assert_eq!(value(metrics, "ferry_nodes"), 2.0);
    }
}

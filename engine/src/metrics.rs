//! A node's statistics for Prometheus: with [`crate::Config::metrics`] (`FERRY_METRICS=HOST:PORT`)
//! every node serves `GET /metrics` in the OpenMetrics text format on `HOST:(PORT + rank)`, so
//! the nodes of one host do not collide. A scrape reads the node's counters at that moment
//! ([`crate::Node::stats`]): key accesses (local, remote, queued), relocations, messages and
//! bytes sent by kind, relocation and blocking latencies and the replicas' staleness (histograms
//! since the last reset, and their median, 99th percentile and largest sample), the local share, intent's moves and late
//! accesses, the peers this node lost, and each peer's send-queue depth. The format comes from `prometheus-client`, the
//! server from `tiny_http` (one thread, which only answers scrapes).

use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

use crate::error::{Error, Result};
use crate::runtime::NodeInner;
use crate::stats::{LATENCY_BUCKET_BOUNDS_NS, Latency, MessageKind, Stats};

/// The node's metrics, read at each scrape.
struct NodeCollector {
    node: Arc<NodeInner>,
}

impl std::fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NodeCollector(rank {})", self.node.config.rank)
    }
}

/// Writes one counter.
fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, value: u64) -> std::fmt::Result {
    let c = ConstCounter::new(value);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

/// Writes a counter with one label, a value per label value.
fn counters(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, label: &str, values: &[(&str, u64)]) -> std::fmt::Result {
    let mut metric = e.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
    for (value_of_label, value) in values {
        ConstCounter::new(*value).encode(metric.encode_family(&[(label, *value_of_label)])?)?;
    }
    Ok(())
}

/// Writes one gauge.
fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, value: f64) -> std::fmt::Result {
    let g = ConstGauge::new(value);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

/// Writes a gauge with one label, a value per label value.
fn gauges(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, label: &str, values: &[(&str, f64)]) -> std::fmt::Result {
    let mut metric = e.encode_descriptor(name, help, None, ConstGauge::new(0.0f64).metric_type())?;
    for (value_of_label, value) in values {
        ConstGauge::new(*value).encode(metric.encode_family(&[(label, *value_of_label)])?)?;
    }
    Ok(())
}

/// A latency distribution as a Prometheus histogram of seconds (buckets from 1 µs to 4.2 s by
/// powers of 4, [`crate::LATENCY_BUCKET_BOUNDS_NS`]).
struct LatencyHistogram<'a>(&'a Latency);

impl EncodeMetric for LatencyHistogram<'_> {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> std::fmt::Result {
        let l = self.0;
        // The encoder adds the buckets up itself; the last one, bounded by f64::MAX, is `+Inf`.
        let bounds = LATENCY_BUCKET_BOUNDS_NS.iter().map(|&ns| ns as f64 / 1e9).chain(std::iter::once(f64::MAX));
        let buckets: Vec<(f64, u64)> = bounds.zip(l.buckets).collect();
        encoder.encode_histogram::<NoLabelSet>(l.sum_ns as f64 / 1e9, l.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// A latency distribution: its histogram (`NAME_seconds_bucket`, `_sum`, `_count`), and its
/// median, 99th percentile and largest sample as gauges (`NAME_quantile_seconds`), which the
/// buckets only bound.
fn latency(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, l: &Latency) -> std::fmt::Result {
    let histogram = LatencyHistogram(l);
    histogram.encode(e.encode_descriptor(&format!("{name}_seconds"), help, None, histogram.metric_type())?)?;
    let seconds = |ns: u64| ns as f64 / 1e9;
    let quantiles = [("0.5", seconds(l.p50_ns)), ("0.99", seconds(l.p99_ns)), ("1", seconds(l.max_ns))];
    gauges(e, &format!("{name}_quantile_seconds"), &format!("{help} (quantiles)"), "quantile", &quantiles)
}

impl Collector for NodeCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s: Stats = self.node.core.stats();
        let config = &self.node.config;
        gauge(&mut e, "ferry_nodes", "nodes in the cluster", config.nodes as f64)?;
        gauge(&mut e, "ferry_rank", "this node's rank", config.rank as f64)?;
        counters(
            &mut e,
            "ferry_key_accesses",
            "keys accessed by this node's workers, by where they were served",
            "served",
            &[("local", s.local_accesses), ("remote", s.remote_accesses), ("queued", s.queued_accesses)],
        )?;
        let accessed = (s.local_accesses + s.remote_accesses).max(1);
        gauge(&mut e, "ferry_local_share", "share of key accesses served from local memory", s.local_accesses as f64 / accessed as f64)?;
        counters(&mut e, "ferry_relocations", "keys relocated to and from this node", "direction", &[("in", s.relocations_in), ("out", s.relocations_out)])?;
        counter(&mut e, "ferry_relocation_writes", "one-sided writes that carried keys away (a run of keys is one write)", s.relocation_writes)?;
        let by_kind = |of: &[u64]| -> Vec<(&'static str, u64)> { MessageKind::ALL.iter().map(|k| (k.name(), of[*k as usize])).collect() };
        counters(&mut e, "ferry_messages_sent", "messages sent to other nodes, by kind", "kind", &by_kind(&s.traffic.messages))?;
        counters(&mut e, "ferry_bytes_sent", "bytes sent to other nodes, by kind", "kind", &by_kind(&s.traffic.bytes))?;
        counter(&mut e, "ferry_bytes_received", "bytes of message frames received from other nodes", s.received_bytes)?;
        latency(&mut e, "ferry_relocation_latency", "time from a localize to the key's arrival", &s.relocation_time)?;
        latency(
            &mut e,
            "ferry_blocking_latency",
            "time a relocating key could not be accessed (its old owner stopped serving it, the new one did not yet)",
            &s.blocking_time,
        )?;
        latency(&mut e, "ferry_replica_staleness", "age of replicated keys' values when read", &s.replication.staleness)?;
        counter(&mut e, "ferry_replica_accesses", "accesses served by replicas of replicated keys", s.replication.replica_accesses)?;
        counter(&mut e, "ferry_intent_relocations", "keys moved here for declared intents", s.intent.acted_keys)?;
        counter(&mut e, "ferry_intent_late_accesses", "accesses to intended keys that were not here yet", s.intent.late_accesses)?;
        gauge(&mut e, "ferry_peers_lost", "peers this node lost", self.node.core.directory().lost_nodes().len() as f64)?;
        counter(&mut e, "ferry_backup_rounds", "backup rounds completed (pushes are acknowledged once their round is)", s.backups.rounds)?;
        counter(&mut e, "ferry_backup_images", "slot images sent to this node's backup", s.backups.images_sent)?;
        counter(&mut e, "ferry_failover_keys", "keys this node took over from lost nodes' backups", s.backups.keys_adopted)?;
        counter(&mut e, "ferry_join_keys_handed", "keys this node handed to nodes that joined", s.backups.keys_handed)?;
        counter(
            &mut e,
            "ferry_leave_keys_given_back",
            "keys of other homes this node gave back as it left a cluster that relocates keys",
            s.backups.keys_given_back,
        )?;
        counter(
            &mut e,
            "ferry_leave_requests_after_ready",
            "requests this node got as it left from a peer after that peer's READY (a fault if not 0)",
            s.backups.requests_after_ready,
        )?;
        gauge(&mut e, "ferry_dynamic_ids_created", "ids of dynamic tables this node created as their home", s.dynamic.ids_created as f64)?;
        gauge(&mut e, "ferry_dynamic_ids_known", "ids of dynamic tables whose slot keys this node knows", s.dynamic.ids_known as f64)?;
        gauge(&mut e, "ferry_dynamic_keys_free", "slot keys of dynamic tables this node can still hand out", s.dynamic.keys_free as f64)?;
        gauge(&mut e, "ferry_dynamic_ids_evicted", "ids of dynamic tables this node evicted as their home", s.dynamic.ids_evicted as f64)?;
        gauge(
            &mut e,
            "ferry_dynamic_ids_deferred",
            "new ids of dynamic tables this home deferred while full or short of room (it evicts)",
            s.dynamic.ids_deferred as f64,
        )?;
        counter(&mut e, "ferry_writes_dropped", "writes of this node's workers that a node's loss failed and that they dropped", s.backups.writes_dropped)?;
        // The send queues' depths (both fabrics keep a queue per peer).
        let depths: Vec<(String, f64)> = (0..config.nodes)
            .filter(|&peer| peer != config.rank)
            .filter_map(|peer| self.node.fabric.queued_bytes(peer).map(|bytes| (peer.to_string(), bytes as f64)))
            .collect();
        let depths: Vec<(&str, f64)> = depths.iter().map(|(peer, bytes)| (peer.as_str(), *bytes)).collect();
        if !depths.is_empty() {
            gauges(&mut e, "ferry_send_queue_bytes", "bytes queued for a peer and not yet taken by its connection", "peer", &depths)?;
        }
        Ok(())
    }
}

/// The address node `rank` serves its metrics on, for the base address `base` (`HOST:PORT`;
/// port 0: a port of the system's choosing for every node, see [`crate::Node::metrics_address`]).
pub(crate) fn address(base: &str, rank: usize) -> Result<String> {
    let (host, port) = base.rsplit_once(':').ok_or_else(|| Error::Config(format!("FERRY_METRICS='{base}' is not HOST:PORT")))?;
    let port: u16 = port.parse().map_err(|_| Error::Config(format!("FERRY_METRICS='{base}': '{port}' is not a port")))?;
    if port == 0 {
        return Ok(base.to_string());
    }
    let port = u16::try_from(rank).ok().and_then(|r| port.checked_add(r)).ok_or_else(|| {
        Error::Config(format!("FERRY_METRICS='{base}': node {rank} would serve on a port beyond 65535 (each node takes the base port plus its rank)"))
    })?;
    Ok(format!("{host}:{port}"))
}

/// A node's metrics endpoint: a thread answering scrapes until dropped.
pub(crate) struct MetricsServer {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Where it listens.
    pub address: std::net::SocketAddr,
}

impl MetricsServer {
    /// Serves `node`'s metrics on `address`.
    pub fn start(node: Arc<NodeInner>, address: &str) -> Result<MetricsServer> {
        let server = Arc::new(tiny_http::Server::http(address).map_err(|e| Error::Config(format!("FERRY_METRICS: cannot listen on {address}: {e}")))?);
        let bound = server.server_addr().to_ip().ok_or_else(|| Error::Config(format!("FERRY_METRICS: {address} is not an IP address")))?;
        let mut registry = Registry::default();
        registry.register_collector(Box::new(NodeCollector { node }));
        let serving = server.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-metrics".into())
            .spawn(move || {
                // `incoming_requests` ends when the server is unblocked (on drop).
                for request in serving.incoming_requests() {
                    let response = if request.url() == "/metrics" || request.url().starts_with("/metrics?") {
                        let mut text = String::new();
                        match prometheus_client::encoding::text::encode(&mut text, &registry) {
                            Ok(()) => tiny_http::Response::from_string(text).with_header(
                                tiny_http::Header::from_bytes("Content-Type", "application/openmetrics-text; version=1.0.0; charset=utf-8")
                                    .expect("a valid header"),
                            ),
                            Err(_) => tiny_http::Response::from_string("encoding the metrics failed\n").with_status_code(500),
                        }
                    } else {
                        tiny_http::Response::from_string("Ferry serves /metrics\n").with_status_code(404)
                    };
                    // A scraper that hung up is no concern of the node's.
                    let _ = request.respond(response);
                }
            })
            .map_err(|e| Error::Config(format!("FERRY_METRICS: cannot start the metrics thread: {e}")))?;
        Ok(MetricsServer { server, thread: Some(thread), address: bound })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_node_takes_the_base_port_plus_its_rank() {
        assert_eq!(address("127.0.0.1:9400", 0).unwrap(), "127.0.0.1:9400");
        assert_eq!(address("0.0.0.0:9400", 3).unwrap(), "0.0.0.0:9403");
        assert_eq!(address("[::1]:9400", 1).unwrap(), "[::1]:9401");
        assert_eq!(address("127.0.0.1:0", 5).unwrap(), "127.0.0.1:0", "the system's choice, for every node");
        for (bad, why) in [("9400", "HOST:PORT"), ("h:x", "not a port"), ("h:65535", "beyond 65535")] {
            let e = address(bad, 1).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }
}

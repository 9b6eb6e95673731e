//! Outgoing protocol traffic of one state-machine step: frames per destination (bounded in size,
//! in order) and a loopback frame for messages a node sends to itself.

use crate::stats::{MessageKind, Traffic};

/// Where full frames go when the runtime wants them at once.
pub(crate) type FrameSink = Box<dyn FnMut(u16, Vec<u8>) + Send>;

pub(crate) struct Outbox {
    rank: u16,
    sink: Option<FrameSink>,
    frame_target: usize,
    current: Vec<Vec<u8>>,
    ready: Vec<(u16, Vec<u8>)>,
    loopback: Vec<u8>,
    pub traffic: Traffic,
}

impl Outbox {
    pub fn new(rank: u16, nodes: usize, frame_target: usize) -> Outbox {
        Outbox {
            rank,
            sink: None,
            frame_target,
            current: (0..nodes).map(|_| Vec::new()).collect(),
            ready: Vec::new(),
            loopback: Vec::new(),
            traffic: Traffic::default(),
        }
    }

    /// The buffer a message to `to` is appended to; call [`Outbox::sent`] after appending.
    #[inline]
    pub fn buf(&mut self, to: u16) -> &mut Vec<u8> {
        if to == self.rank { &mut self.loopback } else { &mut self.current[to as usize] }
    }

    /// Accounts for a message of `bytes` just appended for `to`, sealing the frame when it is
    /// large enough that sending should start.
    #[inline]
    pub fn sent(&mut self, to: u16, kind: MessageKind, bytes: usize) {
        if to == self.rank {
            return;
        }
        self.traffic.add(kind, bytes);
        if self.current[to as usize].len() >= self.frame_target {
            let frame = std::mem::take(&mut self.current[to as usize]);
            match &mut self.sink {
                Some(sink) => sink(to, frame),
                None => self.ready.push((to, frame)),
            }
        }
    }

    pub fn set_sink(&mut self, sink: FrameSink) {
        self.sink = Some(sink);
    }

    /// All frames of the step, sealed, in sending order per destination.
    pub fn take_frames(&mut self) -> Vec<(u16, Vec<u8>)> {
        let mut frames = std::mem::take(&mut self.ready);
        for (to, buf) in self.current.iter_mut().enumerate() {
            if !buf.is_empty() {
                frames.push((to as u16, std::mem::take(buf)));
            }
        }
        frames
    }

    /// Messages to self not yet handled.
    pub fn take_loopback(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.loopback)
    }

    /// Drops everything queued for a lost node.
    pub fn forget(&mut self, to: u16) {
        self.current[to as usize].clear();
        self.ready.retain(|(t, _)| *t != to);
    }
}

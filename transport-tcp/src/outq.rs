//! The per-connection queue of outgoing frames and the code that writes it to the socket.
//!
//! Any thread may append frames and then try a non-blocking vectored write, with the frames taken
//! out of the queue (no system call runs under the queue's lock; while one thread writes, others
//! only append); whatever the socket does not take at once is left for the connection's writer
//! thread, so a caller never blocks on a slow peer and two nodes writing to each other can never
//! deadlock. Frames leave in the order they were appended.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::net::TcpStream;

use socket2::SockRef;

/// Largest fixed frame prefix (common header plus a kind-specific header).
pub(crate) const MAX_HEAD: usize = 32;

/// One queued frame: a small inline prefix and an owned body.
pub(crate) struct OutFrame {
    head: [u8; MAX_HEAD],
    head_len: u8,
    body: Vec<u8>,
}

impl OutFrame {
    /// A frame whose prefix is `head` (at most [`MAX_HEAD`] bytes) followed by `body`.
    pub(crate) fn new(head: &[u8], body: Vec<u8>) -> OutFrame {
        let mut frame = OutFrame { head: [0; MAX_HEAD], head_len: head.len() as u8, body };
        frame.head[..head.len()].copy_from_slice(head);
        frame
    }

    /// Already-encoded frames (possibly several) passed through as they are.
    pub(crate) fn raw(bytes: Vec<u8>) -> OutFrame {
        OutFrame { head: [0; MAX_HEAD], head_len: 0, body: bytes }
    }

    pub(crate) fn len(&self) -> usize {
        self.head_len as usize + self.body.len()
    }
}

/// Frames waiting to be written, plus the state shared with the writer thread.
#[derive(Default)]
pub(crate) struct OutQueue {
    pub frames: VecDeque<OutFrame>,
    /// Bytes of the first frame already written.
    pub front_written: usize,
    /// Some thread is writing frames it took out of the queue: others only queue. Cleared by
    /// that thread when the queue is empty (or by the writer thread, when it took over).
    pub flushing: bool,
    /// The writer thread owns the socket's write side until it clears this.
    pub writer_busy: bool,
    /// The connection is closed; frames are dropped.
    pub closed: bool,
}

/// Writes queued frames until all are written (`Ok(true)`) or the socket would block
/// (`Ok(false)`). `flags` are passed to `sendmsg`; `sent` is told the size of every write.
pub(crate) fn write_frames(
    stream: &TcpStream,
    frames: &mut VecDeque<OutFrame>,
    front_written: &mut usize,
    flags: i32,
    sent: &mut dyn FnMut(usize),
) -> io::Result<bool> {
    const MAX_SLICES: usize = 128;
    let sock = SockRef::from(stream);
    loop {
        if frames.is_empty() {
            return Ok(true);
        }
        let mut slices = [IoSlice::new(&[]); MAX_SLICES];
        let mut count = 0;
        let mut skip = *front_written;
        for frame in frames.iter() {
            if count + 2 > MAX_SLICES {
                break;
            }
            let head = &frame.head[..frame.head_len as usize];
            if skip < head.len() {
                slices[count] = IoSlice::new(&head[skip..]);
                count += 1;
                if !frame.body.is_empty() {
                    slices[count] = IoSlice::new(&frame.body);
                    count += 1;
                }
            } else if skip - head.len() < frame.body.len() {
                slices[count] = IoSlice::new(&frame.body[skip - head.len()..]);
                count += 1;
            }
            skip = 0;
        }
        let written = match sock.send_vectored_with_flags(&slices[..count], flags) {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut => return Ok(false),
            Err(e) => return Err(e),
        };
        if written == 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "socket accepted no bytes"));
        }
        sent(written);
        let mut left = written;
        while left > 0 {
            let remaining = frames.front().map_or(0, |f| f.len() - *front_written);
            if left >= remaining {
                left -= remaining;
                frames.pop_front();
                *front_written = 0;
            } else {
                *front_written += left;
                left = 0;
            }
        }
    }
}

//! The raw TCP baseline: a plain socket pair with `TCP_NODELAY`, exchanging messages of given
//! sizes, either blocking in `read` or busy-polling a non-blocking socket (Ferry's waiting
//! worker spins before it parks, so the fair latency baseline is the better of the two). A
//! ping-pong of Ferry's request and response sizes is the baseline for remote latency; the same
//! exchange with large messages is the raw stream for throughput.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// How both ends wait for the other's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Blocking reads (the thread sleeps in the kernel until data arrives).
    Blocking,
    /// Non-blocking reads retried in a loop (the thread spins).
    BusyPoll,
}

/// Reads exactly `buf.len()` bytes; with `BusyPoll` the socket is non-blocking and retried.
fn read_all(s: &mut TcpStream, buf: &mut [u8], wait: Wait) -> std::io::Result<()> {
    if wait == Wait::Blocking {
        return s.read_exact(buf);
    }
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf`; with `BusyPoll` the socket is non-blocking and retried.
fn write_all(s: &mut TcpStream, buf: &[u8], wait: Wait) -> std::io::Result<()> {
    if wait == Wait::Blocking {
        return s.write_all(buf);
    }
    let mut sent = 0;
    while sent < buf.len() {
        match s.write(&buf[sent..]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Serves exchanges on `port` until the client closes: per phase, a header
/// `[request bytes u64][response bytes u64][count u64][busy-poll u64]`, then `count` times: read
/// the request, write the response.
pub fn serve(port: u16) -> Result<std::thread::JoinHandle<()>> {
    let listener = TcpListener::bind(("127.0.0.1", port)).with_context(|| format!("binding the baseline port {port}"))?;
    Ok(std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else { return };
        let _ = s.set_nodelay(true);
        let mut head = [0u8; 32];
        let mut request = Vec::new();
        let mut response = Vec::new();
        while s.read_exact(&mut head).is_ok() {
            let req = u64::from_le_bytes(head[0..8].try_into().expect("8")) as usize;
            let resp = u64::from_le_bytes(head[8..16].try_into().expect("8")) as usize;
            let count = u64::from_le_bytes(head[16..24].try_into().expect("8"));
            let wait = if head[24] == 1 { Wait::BusyPoll } else { Wait::Blocking };
            request.resize(req, 0);
            response.resize(resp, 7);
            if s.set_nonblocking(wait == Wait::BusyPoll).is_err() {
                return;
            }
            for _ in 0..count {
                if read_all(&mut s, &mut request, wait).is_err() || write_all(&mut s, &response, wait).is_err() {
                    return;
                }
            }
            if s.set_nonblocking(false).is_err() {
                return;
            }
        }
    }))
}

/// The client side of the baseline.
pub struct Client {
    stream: TcpStream,
}

impl Client {
    /// Connects to the baseline server (retrying while it starts).
    pub fn connect(port: u16) -> Result<Client> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match TcpStream::connect(("127.0.0.1", port)) {
                Ok(s) => {
                    s.set_nodelay(true)?;
                    return Ok(Client { stream: s });
                }
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(e).context("connecting to the baseline server"),
            }
        }
    }

    /// Runs `count` blocking exchanges of `request` bytes out and `response` bytes back,
    /// calling `each(duration)` per exchange.
    pub fn exchange(&mut self, request: usize, response: usize, count: u64, each: impl FnMut(Duration)) -> Result<()> {
        self.exchange_with(Wait::Blocking, request, response, count, each)
    }

    /// Runs `count` exchanges with both ends waiting as `wait` says.
    pub fn exchange_with(&mut self, wait: Wait, request: usize, response: usize, count: u64, mut each: impl FnMut(Duration)) -> Result<()> {
        let mut head = [0u8; 32];
        head[0..8].copy_from_slice(&(request as u64).to_le_bytes());
        head[8..16].copy_from_slice(&(response as u64).to_le_bytes());
        head[16..24].copy_from_slice(&count.to_le_bytes());
        head[24] = (wait == Wait::BusyPoll) as u8;
        self.stream.write_all(&head)?;
        let out = vec![1u8; request];
        let mut back = vec![0u8; response];
        self.stream.set_nonblocking(wait == Wait::BusyPoll)?;
        for _ in 0..count {
            let t = Instant::now();
            write_all(&mut self.stream, &out, wait)?;
            read_all(&mut self.stream, &mut back, wait)?;
            each(t.elapsed());
        }
        self.stream.set_nonblocking(false)?;
        Ok(())
    }
}

//! The raw TCP baseline: a plain blocking socket pair with `TCP_NODELAY`, exchanging messages of
//! given sizes. A ping-pong of Ferry's request and response sizes is the baseline for remote
//! latency; the same exchange with large messages is the raw stream for throughput.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// Serves exchanges on `port` until the client closes: per phase, a header
/// `[request bytes u64][response bytes u64][count u64]`, then `count` times: read the request,
/// write the response.
pub fn serve(port: u16) -> Result<std::thread::JoinHandle<()>> {
    let listener = TcpListener::bind(("127.0.0.1", port)).with_context(|| format!("binding the baseline port {port}"))?;
    Ok(std::thread::spawn(move || {
        let Ok((mut s, _)) = listener.accept() else { return };
        let _ = s.set_nodelay(true);
        let mut head = [0u8; 24];
        let mut request = Vec::new();
        let mut response = Vec::new();
        while s.read_exact(&mut head).is_ok() {
            let req = u64::from_le_bytes(head[0..8].try_into().expect("8")) as usize;
            let resp = u64::from_le_bytes(head[8..16].try_into().expect("8")) as usize;
            let count = u64::from_le_bytes(head[16..24].try_into().expect("8"));
            request.resize(req, 0);
            response.resize(resp, 7);
            for _ in 0..count {
                if s.read_exact(&mut request).is_err() || s.write_all(&response).is_err() {
                    return;
                }
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

    /// Runs `count` exchanges of `request` bytes out and `response` bytes back, calling
    /// `each(duration)` per exchange.
    pub fn exchange(&mut self, request: usize, response: usize, count: u64, mut each: impl FnMut(Duration)) -> Result<()> {
        let mut head = [0u8; 24];
        head[0..8].copy_from_slice(&(request as u64).to_le_bytes());
        head[8..16].copy_from_slice(&(response as u64).to_le_bytes());
        head[16..24].copy_from_slice(&count.to_le_bytes());
        self.stream.write_all(&head)?;
        let out = vec![1u8; request];
        let mut back = vec![0u8; response];
        for _ in 0..count {
            let t = Instant::now();
            self.stream.write_all(&out)?;
            self.stream.read_exact(&mut back)?;
            each(t.elapsed());
        }
        Ok(())
    }
}

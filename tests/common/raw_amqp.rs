//! A raw AMQP 0-9-1 publisher, frame by frame, for what no client library will send: property
//! short strings (`message-id`, `content-type`, `reply-to`) that are not valid UTF-8. The broker
//! accepts them; this is how a foreign publisher puts such a message in a queue.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Raw property values of one message (bytes, not text).
#[derive(Debug, Default, Clone)]
pub struct RawProperties {
    pub content_type: Option<Vec<u8>>,
    pub reply_to: Option<Vec<u8>>,
    pub message_id: Option<Vec<u8>>,
    /// 2 = persistent.
    pub delivery_mode: Option<u8>,
}

fn short(out: &mut Vec<u8>, s: &[u8]) {
    out.push(s.len() as u8);
    out.extend_from_slice(s);
}

fn long(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    f
}

fn method(channel: u16, class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class.to_be_bytes().to_vec();
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(args);
    frame(1, channel, &p)
}

/// Reads frames until the method `(class, id)` arrives on any channel; fails on a close.
async fn expect(stream: &mut TcpStream, class: u16, id: u16) -> Result<Vec<u8>, String> {
    loop {
        let mut header = [0u8; 7];
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
        let mut payload = vec![0u8; size + 1];
        stream
            .read_exact(&mut payload)
            .await
            .map_err(|e| format!("read: {e}"))?;
        payload.pop();
        if header[0] != 1 || payload.len() < 4 {
            continue;
        }
        let got = (
            u16::from_be_bytes([payload[0], payload[1]]),
            u16::from_be_bytes([payload[2], payload[3]]),
        );
        if got == (class, id) {
            return Ok(payload[4..].to_vec());
        }
        if got == (10, 50) || got == (20, 40) {
            let text_len = payload.get(6).copied().unwrap_or(0) as usize;
            let text = payload.get(7..7 + text_len).unwrap_or_default();
            return Err(format!(
                "the broker closed: {}",
                String::from_utf8_lossy(text)
            ));
        }
    }
}

/// Publishes one message to `exchange`/`routing_key` on a connection of its own, with publisher
/// confirms, and waits for the broker's ack. `amqp_url` gives host, port, user and password.
pub async fn publish(
    amqp_url: &str,
    exchange: &str,
    routing_key: &str,
    properties: &RawProperties,
    body: &[u8],
) -> Result<(), String> {
    let url = url::Url::parse(amqp_url).map_err(|e| e.to_string())?;
    let host = url.host_str().unwrap_or("127.0.0.1").to_string();
    let port = url.port().unwrap_or(5672);
    let user = if url.username().is_empty() {
        "guest".to_string()
    } else {
        url.username().to_string()
    };
    let password = url.password().unwrap_or("guest").to_string();
    let work = async {
        let mut s = TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"AMQP\x00\x00\x09\x01")
            .await
            .map_err(|e| e.to_string())?;
        expect(&mut s, 10, 10).await?; // connection.start
        let mut args = Vec::new();
        args.extend_from_slice(&0u32.to_be_bytes()); // client properties: empty table
        short(&mut args, b"PLAIN");
        long(&mut args, format!("\0{user}\0{password}").as_bytes());
        short(&mut args, b"en_US");
        s.write_all(&method(0, 10, 11, &args))
            .await
            .map_err(|e| e.to_string())?;
        let tune = expect(&mut s, 10, 30).await?;
        let mut ok = tune[0..2].to_vec(); // channel-max as offered
        ok.extend_from_slice(&131_072u32.to_be_bytes());
        ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        s.write_all(&method(0, 10, 31, &ok))
            .await
            .map_err(|e| e.to_string())?;
        let mut open = Vec::new();
        short(&mut open, b"/");
        short(&mut open, b"");
        open.push(0);
        s.write_all(&method(0, 10, 40, &open))
            .await
            .map_err(|e| e.to_string())?;
        expect(&mut s, 10, 41).await?;
        s.write_all(&method(1, 20, 10, &[0]))
            .await
            .map_err(|e| e.to_string())?;
        expect(&mut s, 20, 11).await?;
        s.write_all(&method(1, 85, 10, &[0]))
            .await
            .map_err(|e| e.to_string())?;
        expect(&mut s, 85, 11).await?;

        let mut publish = 0u16.to_be_bytes().to_vec();
        short(&mut publish, exchange.as_bytes());
        short(&mut publish, routing_key.as_bytes());
        publish.push(1); // mandatory
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        let mut flags = 0u16;
        let mut list = Vec::new();
        if let Some(v) = &properties.content_type {
            flags |= 1 << 15;
            short(&mut list, v);
        }
        if let Some(v) = properties.delivery_mode {
            flags |= 1 << 12;
            list.push(v);
        }
        if let Some(v) = &properties.reply_to {
            flags |= 1 << 9;
            short(&mut list, v);
        }
        if let Some(v) = &properties.message_id {
            flags |= 1 << 7;
            short(&mut list, v);
        }
        header.extend_from_slice(&flags.to_be_bytes());
        header.extend_from_slice(&list);
        let mut out = method(1, 60, 40, &publish);
        out.extend(frame(2, 1, &header));
        out.extend(frame(3, 1, body));
        s.write_all(&out).await.map_err(|e| e.to_string())?;
        expect(&mut s, 60, 80).await?; // basic.ack (confirm)
        let mut close = 200u16.to_be_bytes().to_vec();
        short(&mut close, b"bye");
        close.extend_from_slice(&[0, 0, 0, 0]);
        s.write_all(&method(0, 10, 50, &close))
            .await
            .map_err(|e| e.to_string())?;
        let _ = expect(&mut s, 10, 51).await;
        Ok(())
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| "raw publish timed out".to_string())?
}

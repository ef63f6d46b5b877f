//! A raw AMQP 0-9-1 publisher, frame by frame, for what no client library will send: property
//! short strings that are not valid UTF-8, header tables given as raw bytes (keys of any bytes,
//! nesting deeper than a client would encode recursively). The broker accepts them; this is how
//! a foreign publisher puts such a message in a queue.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Raw property values of one message (bytes, not text), in the order AMQP encodes them.
#[derive(Debug, Default, Clone)]
pub struct RawProperties {
    pub content_type: Option<Vec<u8>>,
    pub content_encoding: Option<Vec<u8>>,
    /// The content of a field table (without its 4-byte length): see [`table`].
    pub headers: Option<Vec<u8>>,
    /// 2 = persistent.
    pub delivery_mode: Option<u8>,
    pub priority: Option<u8>,
    pub correlation_id: Option<Vec<u8>>,
    pub reply_to: Option<Vec<u8>>,
    pub expiration: Option<Vec<u8>>,
    pub message_id: Option<Vec<u8>>,
    pub timestamp: Option<u64>,
    pub kind: Option<Vec<u8>>,
    pub user_id: Option<Vec<u8>>,
    pub app_id: Option<Vec<u8>>,
    pub cluster_id: Option<Vec<u8>>,
}

impl RawProperties {
    /// The property flags and list of a content header.
    pub fn encode(&self) -> Vec<u8> {
        let mut flags = 0u16;
        let mut list = Vec::new();
        let mut bit = 15;
        let mut field = |present: bool, write: &mut dyn FnMut(&mut Vec<u8>)| {
            if present {
                flags |= 1 << bit;
                write(&mut list);
            }
            bit -= 1;
        };
        let shortstr = |v: &Option<Vec<u8>>| {
            let v = v.clone();
            move |out: &mut Vec<u8>| short(out, v.as_deref().unwrap_or_default())
        };
        field(
            self.content_type.is_some(),
            &mut shortstr(&self.content_type),
        );
        field(
            self.content_encoding.is_some(),
            &mut shortstr(&self.content_encoding),
        );
        let headers = self.headers.clone();
        field(headers.is_some(), &mut |out: &mut Vec<u8>| {
            long(out, headers.as_deref().unwrap_or_default())
        });
        let mode = self.delivery_mode;
        field(mode.is_some(), &mut |out: &mut Vec<u8>| {
            out.push(mode.unwrap_or(0))
        });
        let priority = self.priority;
        field(priority.is_some(), &mut |out: &mut Vec<u8>| {
            out.push(priority.unwrap_or(0))
        });
        field(
            self.correlation_id.is_some(),
            &mut shortstr(&self.correlation_id),
        );
        field(self.reply_to.is_some(), &mut shortstr(&self.reply_to));
        field(self.expiration.is_some(), &mut shortstr(&self.expiration));
        field(self.message_id.is_some(), &mut shortstr(&self.message_id));
        let timestamp = self.timestamp;
        field(timestamp.is_some(), &mut |out: &mut Vec<u8>| {
            out.extend_from_slice(&timestamp.unwrap_or(0).to_be_bytes())
        });
        field(self.kind.is_some(), &mut shortstr(&self.kind));
        field(self.user_id.is_some(), &mut shortstr(&self.user_id));
        field(self.app_id.is_some(), &mut shortstr(&self.app_id));
        field(self.cluster_id.is_some(), &mut shortstr(&self.cluster_id));
        let mut out = flags.to_be_bytes().to_vec();
        out.extend(list);
        out
    }
}

/// One raw field-table entry: a key of any bytes (at most 255) and a value given as its type
/// byte and encoded bytes.
pub fn entry(out: &mut Vec<u8>, key: &[u8], value: &[u8]) {
    short(out, key);
    out.extend_from_slice(value);
}

/// A field table value (`F`) holding `content` (the entries, already encoded).
pub fn table(content: &[u8]) -> Vec<u8> {
    let mut v = vec![b'F'];
    long(&mut v, content);
    v
}

/// A long string value (`S`).
pub fn long_str(bytes: &[u8]) -> Vec<u8> {
    let mut v = vec![b'S'];
    long(&mut v, bytes);
    v
}

/// A table value nested `depth` levels deep (each level one entry `k`), built without recursion.
pub fn nested_table(depth: usize) -> Vec<u8> {
    let mut value = table(&[]);
    for _ in 0..depth {
        let mut content = Vec::new();
        entry(&mut content, b"k", &value);
        value = table(&content);
    }
    value
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

/// A publisher connection of its own, frame by frame, in confirm mode: publishes one message at
/// a time and waits for the broker's answer. A message the broker refuses by closing the
/// channel or the connection (a `user_id` that is not the connection's user, a frame over the
/// limit) is reported, and the next publish connects again.
pub struct RawPublisher {
    host: String,
    port: u16,
    user: String,
    password: String,
    stream: Option<TcpStream>,
}

/// How the broker answered one publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Confirmed and routed: the broker took it.
    Taken,
    /// Returned as unroutable, or nacked: the broker did not take it.
    NotTaken,
    /// The broker closed the channel or the connection over it (not taken).
    Closed(String),
}

impl RawPublisher {
    /// `amqp_url` gives host, port, user and password; connecting waits for the first publish.
    pub fn new(amqp_url: &str) -> Result<Self, String> {
        let url = url::Url::parse(amqp_url).map_err(|e| e.to_string())?;
        Ok(Self {
            host: url.host_str().unwrap_or("127.0.0.1").to_string(),
            port: url.port().unwrap_or(5672),
            user: if url.username().is_empty() {
                "guest".to_string()
            } else {
                url.username().to_string()
            },
            password: url.password().unwrap_or("guest").to_string(),
            stream: None,
        })
    }

    async fn open(&self) -> Result<TcpStream, String> {
        let mut s = TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        s.write_all(b"AMQP\x00\x00\x09\x01")
            .await
            .map_err(|e| e.to_string())?;
        expect(&mut s, 10, 10).await?; // connection.start
        let mut args = Vec::new();
        args.extend_from_slice(&0u32.to_be_bytes()); // client properties: empty table
        short(&mut args, b"PLAIN");
        long(
            &mut args,
            format!("\0{}\0{}", self.user, self.password).as_bytes(),
        );
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
        Ok(s)
    }

    /// Publishes one message (mandatory) and waits for the broker's answer (bounded).
    pub async fn publish(
        &mut self,
        exchange: &str,
        routing_key: &str,
        properties: &RawProperties,
        body: &[u8],
    ) -> Result<Answer, String> {
        let mut s = match self.stream.take() {
            Some(s) => s,
            None => self.open().await?,
        };
        let mut publish = 0u16.to_be_bytes().to_vec();
        short(&mut publish, exchange.as_bytes());
        short(&mut publish, routing_key.as_bytes());
        publish.push(1); // mandatory
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend(properties.encode());
        let mut out = method(1, 60, 40, &publish);
        out.extend(frame(2, 1, &header));
        // Bodies in frames of at most the frame size agreed above.
        for part in body.chunks(131_072 - 8) {
            out.extend(frame(3, 1, part));
        }
        let answer = async {
            s.write_all(&out).await.map_err(|e| e.to_string())?;
            let mut returned = false;
            loop {
                match next_method(&mut s).await? {
                    (60, 50) => returned = true,
                    (60, 80) => {
                        return Ok(if returned {
                            Answer::NotTaken
                        } else {
                            Answer::Taken
                        });
                    }
                    (60, 120) => return Ok(Answer::NotTaken),
                    (20, 40) | (10, 50) => {
                        return Ok(Answer::Closed("closed by the broker".into()));
                    }
                    _ => {}
                }
            }
        };
        let answer: Result<Answer, String> =
            match tokio::time::timeout(Duration::from_secs(10), answer).await {
                Ok(a) => a,
                Err(_) => Err("no answer within 10 s".into()),
            };
        if let Ok(Answer::Taken | Answer::NotTaken) = answer {
            self.stream = Some(s);
        }
        answer
    }
}

/// Reads frames until a method frame arrives: its (class, method).
async fn next_method(stream: &mut TcpStream) -> Result<(u16, u16), String> {
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
        if header[0] == 1 && payload.len() >= 5 {
            return Ok((
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
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
    let mut publisher = RawPublisher::new(amqp_url)?;
    match publisher
        .publish(exchange, routing_key, properties, body)
        .await?
    {
        Answer::Taken => Ok(()),
        other => Err(format!("not taken: {other:?}")),
    }
}

//! What `minimal_pipeline` and `tuned_pipeline` share: what they drain where (their common
//! arguments), the message body they decode, the batch of columns the UNNEST insert takes, the
//! database connection, and the one result line `scripts/bench.sh` reads (the same keys from
//! both, so the script treats them alike).

use uuid::Uuid;

/// What a pipeline drains, and into which table.
#[derive(Debug, clap::Args)]
pub struct Drain {
    /// Queue to drain.
    #[arg(long, env = "MAIN_QUEUE")]
    pub queue: String,
    /// Messages to drain; the pipeline stops once N are acked.
    #[arg(long)]
    pub count: u64,
    /// Schema holding the `users` table (created by `warren declare`).
    #[arg(long, env = "DATABASE_SCHEMA")]
    pub schema: String,
}

/// The message body `warren publish` sends.
#[derive(serde::Deserialize)]
struct User {
    id: Uuid,
    name: String,
    email: String,
}

/// The columns of a batch being collected, as the UNNEST insert takes them.
#[derive(Default)]
pub struct Batch {
    pub ids: Vec<Uuid>,
    pub names: Vec<String>,
    pub emails: Vec<String>,
    /// Deliveries in the batch, decodable or not (all of them are acked with it).
    pub len: usize,
    /// Undecodable bodies among them (acked with the batch, not inserted).
    pub invalid: usize,
    /// The highest delivery tag of the batch: the one multi-ack settles them all.
    pub last_tag: u64,
}

impl Batch {
    /// Adds one delivery: its columns if the body decodes, else it only counts.
    pub fn push(&mut self, tag: u64, body: &[u8]) {
        match serde_json::from_slice::<User>(body) {
            Ok(user) => {
                self.ids.push(user.id);
                self.names.push(user.name);
                self.emails.push(user.email);
            }
            Err(_) => self.invalid += 1,
        }
        self.len += 1;
        self.last_tag = tag;
    }

    /// Empties the batch, keeping its buffers.
    pub fn clear(&mut self) {
        self.ids.clear();
        self.names.clear();
        self.emails.clear();
        self.len = 0;
        self.invalid = 0;
    }
}

/// `INSERT INTO <schema>.users .. SELECT * FROM UNNEST(..)` followed by `tail` (an ON CONFLICT
/// clause, or nothing).
pub fn unnest_insert(schema: &str, tail: &str) -> String {
    format!(
        "INSERT INTO {schema}.users (id, name, email) \
         SELECT * FROM UNNEST($1::uuid[], $2::text[], $3::text[]){tail}"
    )
}

/// One connection to `DATABASE_URL`, its I/O driven by a task of its own; `who` names the
/// example in the line printed when the connection fails.
pub async fn connect(who: &'static str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) =
        tokio_postgres::connect(&super::database_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!("{who}: database connection: {e}");
        }
    });
    Ok(client)
}

/// What a drain did, for the result line.
#[derive(Default)]
pub struct Drained {
    /// Deliveries committed (or found undecodable) and acked.
    pub settled: u64,
    /// Rows the inserts reported.
    pub inserted: u64,
    /// Undecodable bodies among the settled (acked, not inserted).
    pub invalid: u64,
    /// `basic.ack` frames sent.
    pub acks: u64,
    /// Batch inserts sent.
    pub batches: u64,
}

/// Prints the result line; `secs` is the drain's time by the pipeline's own clock, from the
/// start of `main` to its last ack (`scripts/bench.sh` keeps it in its logs and times every
/// contender itself, from the broker).
pub fn report(who: &str, secs: f64, d: &Drained) -> std::io::Result<()> {
    let usage = super::usage()?;
    println!(
        "{who} messages={} secs={secs:.3} rate={:.0} inserted={} invalid={} acks={} batches={} cpu_us={} peak_rss_kb={}",
        d.settled,
        d.settled as f64 / secs.max(1e-9),
        d.inserted,
        d.invalid,
        d.acks,
        d.batches,
        usage.cpu.as_micros(),
        usage.peak_rss_kb
    );
    Ok(())
}

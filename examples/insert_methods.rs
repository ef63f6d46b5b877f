//! What each way of inserting a batch of new users costs PostgreSQL, for the choice of warren's
//! insert (docs/performance.md, "The cheapest idempotent insert"). For each method it inserts
//! `--batches` batches of `--batch-size` new rows into a fresh `users` table of its own schema,
//! one statement (or one COPY) a batch, in autocommit as warren does, and prints the wall time
//! and the CPU the server process of its connection spent (from `/proc/<backend pid>/stat`, so
//! run it on the database's machine), per row. Methods:
//!
//! - `unnest`: `INSERT .. SELECT FROM UNNEST($1::uuid[], ..) ORDER BY id` (warren's first try).
//! - `unnest_on_conflict`: the same with `ON CONFLICT DO NOTHING` (its fallback).
//! - `copy_binary`: `COPY users (id, name, email) FROM STDIN (FORMAT binary)`, rows sorted by id.
//!
//! `cargo run --release --example insert_methods -- --batches 200 --reps 3`

use std::time::{Duration, Instant};

use clap::Parser;
use futures::pin_mut;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, NoTls, Statement};
use uuid::Uuid;

#[derive(Debug, Parser)]
#[command(about = "PostgreSQL's CPU a row for each way of inserting a batch of new users")]
struct Args {
    #[arg(long, default_value = "host=127.0.0.1 user=postgres dbname=postgres")]
    database: String,
    #[arg(long, default_value_t = 200)]
    batches: usize,
    #[arg(long, default_value_t = 1000)]
    batch_size: usize,
    /// Repetitions of every method, interleaved.
    #[arg(long, default_value_t = 3)]
    reps: usize,
}

const METHODS: [&str; 3] = ["unnest", "unnest_on_conflict", "copy_binary"];

fn backend_cpu(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses): utime is the 14th field.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0u64)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0u64);
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

struct Row {
    id: Uuid,
    name: String,
    email: String,
}

fn batch(size: usize) -> Vec<Row> {
    let mut rows: Vec<Row> = (0..size)
        .map(|_| {
            let id = Uuid::new_v4();
            Row {
                id,
                name: format!("User {}", &id.simple().to_string()[..8]),
                email: format!("{}@example.com", id.simple()),
            }
        })
        .collect();
    rows.sort_by_key(|r| r.id);
    rows
}

async fn insert(client: &Client, statement: Option<&Statement>, rows: &[Row]) -> u64 {
    match statement {
        None => {
            let sink = client
                .copy_in("COPY users (id, name, email) FROM STDIN (FORMAT binary)")
                .await
                .expect("copy");
            let writer = BinaryCopyInWriter::new(sink, &[Type::UUID, Type::TEXT, Type::TEXT]);
            pin_mut!(writer);
            for r in rows {
                writer
                    .as_mut()
                    .write(&[&r.id, &r.name, &r.email])
                    .await
                    .expect("row");
            }
            writer.finish().await.expect("finish")
        }
        Some(statement) => {
            let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
            let names: Vec<&str> = rows.iter().map(|r| r.name.as_str()).collect();
            let emails: Vec<&str> = rows.iter().map(|r| r.email.as_str()).collect();
            client
                .execute(statement, &[&ids, &names, &emails])
                .await
                .expect("insert")
        }
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args = Args::parse();
    let (client, connection) = tokio_postgres::connect(&args.database, NoTls)
        .await
        .expect("connect to PostgreSQL");
    tokio::spawn(connection);
    let schema = format!("insert_methods_{}", std::process::id());
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema}; SET search_path = {schema}"
        ))
        .await
        .expect("schema");
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pid")
        .get(0);
    println!("method               rep   rows/s  db us/row  wall us/row");
    for rep in 1..=args.reps {
        for method in METHODS {
            client
                .batch_execute(
                    "DROP TABLE IF EXISTS users; CREATE TABLE users (id uuid PRIMARY KEY, \
                     name text NOT NULL, email text NOT NULL UNIQUE, \
                     inserted_at timestamptz NOT NULL DEFAULT now())",
                )
                .await
                .expect("table");
            let batches: Vec<Vec<Row>> =
                (0..args.batches).map(|_| batch(args.batch_size)).collect();
            let statement = match method {
                "copy_binary" => None,
                _ => {
                    let mut sql = "INSERT INTO users (id, name, email) SELECT * FROM \
                         UNNEST($1::uuid[], $2::text[], $3::text[]) AS v(id, name, email) \
                         ORDER BY id"
                        .to_string();
                    if method == "unnest_on_conflict" {
                        sql.push_str(" ON CONFLICT DO NOTHING");
                    }
                    Some(client.prepare(&sql).await.expect("prepare"))
                }
            };
            let cpu = backend_cpu(pid);
            let start = Instant::now();
            let mut total = 0;
            for b in &batches {
                total += insert(&client, statement.as_ref(), b).await;
            }
            let wall = start.elapsed();
            let db = backend_cpu(pid) - cpu;
            assert_eq!(total as usize, args.batches * args.batch_size);
            println!(
                "{method:<20} {rep:>3} {:>8.0} {:>10.2} {:>12.2}",
                total as f64 / wall.as_secs_f64(),
                db.as_secs_f64() * 1e6 / total as f64,
                wall.as_secs_f64() * 1e6 / total as f64
            );
        }
    }
    client
        .batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
        .await
        .expect("drop schema");
}

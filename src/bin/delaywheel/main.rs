//! `delaywheel`: the command line of an operator of a delaywheel queue in Redis (feature
//! `cli`). It inspects a queue (`stats`, `ls`, `get`), acts on single tasks (`cancel`,
//! `requeue`) or on every dead letter (`requeue --all-dead`, paced), and pauses or resumes
//! every consumer. Human tables by default, one JSON document with `--json`.
//!
//! Exit codes: 0 done; 1 an error (Redis unreachable, an unknown namespace or one of the
//! other kind, a refused requeue); 2 a usage error (clap's, a bad cursor or one of another
//! listing, a bad refresh, a `--limit` of 0 or past 10 000); 3 the id is not there.

mod census;
mod commands;
mod dashboard;
mod output;

use clap::{Parser, Subcommand, ValueEnum};
use delaywheel::redis::{Producer, QueueConfig, QueueError};

/// Operate a delaywheel queue in Redis: inspect it, pause it, cancel and requeue tasks.
#[derive(Parser, Debug)]
#[command(name = "delaywheel", version)]
struct Cli {
    /// Redis URL, or with --cluster the cluster's node URLs (comma-separated). Read from
    /// DELAYWHEEL_REDIS_URL when not given, so that a password does not show in `ps`.
    #[arg(
        long,
        env = "DELAYWHEEL_REDIS_URL",
        hide_env_values = true,
        default_value = "redis://127.0.0.1/"
    )]
    redis: String,
    /// The URLs are Redis Cluster nodes.
    #[arg(long)]
    cluster: bool,
    /// The queue's namespace, as its producers and consumers were given it.
    #[arg(long, env = "DELAYWHEEL_NAMESPACE")]
    namespace: String,
    /// The queue's shard count, as its producers and consumers were given it.
    #[arg(long, default_value_t = 1)]
    shards: u32,
    /// One JSON document on stdout instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Depths (queued, leased, dead), the latency (age of the oldest due, unclaimed task) and
    /// whether the queue is paused.
    Stats,
    /// One page of tasks in a state: scheduled and leased in due order, dead letters by shard.
    Ls {
        /// Which tasks.
        state: State,
        /// Tasks per page, 1 to 10 000 (a page is read by one script per shard, which Redis
        /// runs alone: a larger one would stall the queue's consumers).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
        /// Where to go on from: the `next` a previous page printed.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// One task: its state, envelope, due time and attempts.
    Get {
        /// The task id.
        id: String,
    },
    /// Cancels one task, queued or claimed.
    Cancel {
        /// The task id.
        id: String,
    },
    /// Moves a dead-lettered task back to the queue, due now; or, with --all-dead, every
    /// dead letter, paced at --rate per second so that they do not all come due at once.
    Requeue {
        /// The task id.
        #[arg(required_unless_present = "all_dead", conflicts_with = "all_dead")]
        id: Option<String>,
        /// Every dead letter of the queue.
        #[arg(long)]
        all_dead: bool,
        /// Requeues per second with --all-dead.
        #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..))]
        rate: u32,
    },
    /// Stops every consumer of the queue from claiming. Enqueue goes on; tasks already
    /// claimed still fire (those due within the consumers' lookahead).
    Pause,
    /// Lifts a pause, and wakes every consumer at once.
    Resume,
    /// The periodic schedules registered for the queue.
    Schedules,
    /// Serves a read-only page of the queue (shards, topics, a census of each topic's
    /// queued, leased and dead tasks, a chart of the last minutes, the dead letters) that
    /// refreshes itself. It binds to loopback by default, and there answers only requests
    /// for a loopback host (not a page that points its own name at 127.0.0.1) or an
    /// --allow-host: to reach it from elsewhere, put it behind a reverse proxy that
    /// authenticates (it has no login), and allow the host name the proxy forwards.
    Dashboard {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8077")]
        listen: std::net::SocketAddr,
        /// Seconds between the page's refreshes.
        #[arg(long, default_value_t = 2.0)]
        refresh: f64,
        /// Tasks a second, at most, that the census of topics reads (it walks the whole
        /// queue to count each topic's queued, leased and dead tasks).
        #[arg(long, default_value_t = 10_000)]
        census_rate: u64,
        /// A host name, besides loopback ones, that requests may name (the one a reverse
        /// proxy forwards); repeat for several.
        #[arg(long = "allow-host")]
        allow_host: Vec<String>,
    },
}

/// The states `ls` lists.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum State {
    Scheduled,
    Leased,
    Dead,
}

/// How a command ended: its exit code.
enum Exit {
    Done,
    NotFound,
    Failed,
    Usage,
}

/// A failure as one line on stderr, with the causes it wraps.
fn fail(what: &str, e: &(dyn std::error::Error + 'static)) -> Exit {
    let mut line = format!("delaywheel: {what}: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        // A wrapped error often repeats its source's text: say each once.
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(&format!(": {text}"));
        }
        source = s.source();
    }
    eprintln!("{line}");
    Exit::Failed
}

async fn connect(cli: &Cli) -> Result<Producer, QueueError> {
    // Split only for a cluster: a single URL may hold a comma (in its password).
    let nodes: Vec<String> = if cli.cluster {
        cli.redis.split(',').map(|u| u.trim().to_owned()).collect()
    } else {
        vec![cli.redis.trim().to_owned()]
    };
    let mut cfg = QueueConfig::new(nodes[0].clone(), cli.namespace.as_str());
    if cli.cluster {
        cfg.cluster_nodes = nodes;
    }
    cfg.shards = cli.shards;
    Producer::connect_existing(cfg).await
}

async fn run(cli: Cli) -> Exit {
    let producer = match connect(&cli).await {
        Ok(p) => p,
        Err(QueueError::UnknownNamespace(ns)) => {
            eprintln!(
                "delaywheel: no queue in namespace {ns:?} at this Redis (check --namespace and --shards)"
            );
            return Exit::Failed;
        }
        Err(QueueError::InUse(e)) => {
            eprintln!("delaywheel: {e}");
            return Exit::Failed;
        }
        Err(e) => return fail("cannot open the queue", &e),
    };
    if let Command::Dashboard {
        listen,
        refresh,
        census_rate,
        allow_host,
    } = cli.command
    {
        if !(0.1..=3600.0).contains(&refresh) {
            eprintln!("delaywheel: --refresh must be between 0.1 and 3600 seconds");
            return Exit::Usage;
        }
        if census_rate == 0 {
            eprintln!("delaywheel: --census-rate must be at least 1");
            return Exit::Usage;
        }
        let every = std::time::Duration::from_secs_f64(refresh);
        return dashboard::serve(
            producer,
            &cli.namespace,
            listen,
            every,
            census_rate,
            &allow_host,
        )
        .await;
    }
    commands::run(&producer, cli.command, cli.json).await
}

fn main() {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            fail("cannot start a runtime", &e);
            std::process::exit(1);
        }
    };
    let code = match rt.block_on(run(cli)) {
        Exit::Done => 0,
        Exit::Failed => 1,
        Exit::NotFound => 3,
        Exit::Usage => 2,
    };
    std::process::exit(code);
}

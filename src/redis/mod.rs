//! The Redis layer (feature `redis`), in two roles:
//!
//! * [`Persistent`]: an engine whose tasks survive a restart. A write-behind flusher mirrors
//!   them into a [`TaskStore`] ([`RedisStore`] by default) and [`Persistent::restore`] reloads
//!   them.
//! * [`Producer`] and [`Consumer`]: a delay queue shared by many instances. Each consumer
//!   claims the tasks due within its lookahead window, atomically and under a fencing token,
//!   and fires each from its own wheel at the due millisecond.
//!
//! The files: the parts both roles use at this folder's root (`link.rs`, the connection to a
//! node or a cluster; `layout.rs`, the key names; `envelope.rs`, the task envelope;
//! `wall_clock.rs`, epoch milliseconds; `store_error.rs`; `blocking.rs`, the runtime the
//! blocking APIs run on), then one folder per role, `persist/` and `queue/`, neither of which
//! uses the other. Every Lua script is a `.lua` file beside the module that runs it.
//!
//! The examples below need a running Redis, so they are compiled but not run here; the tests
//! in `tests/redis_*.rs`, `tests/persist_*.rs` and `tests/queue.rs` run the same calls against
//! a private `redis-server`.
//!
//! ```no_run
//! use std::time::Duration;
//! use delaywheel::redis::{PersistConfig, Persistent};
//!
//! let (engine, fired) = Persistent::start(PersistConfig::new("redis://127.0.0.1/", "orders"))?;
//! engine.restore(4_000)?; // what the previous process left, 4 000 entries per page
//! engine.schedule("order:42", "order.close", serde_json::json!({ "order_id": 42 }), Duration::from_secs(30 * 60))?;
//! for task in fired {
//!     // close the order if it is still unpaid (idempotently), then:
//!     engine.ack(&task);
//! }
//! # Ok::<(), delaywheel::redis::PersistError>(())
//! ```
//!
//! ```no_run
//! use std::time::Duration;
//! use delaywheel::redis::{Consumer, Handlers, Producer, QueueConfig, When};
//!
//! # async fn run() -> Result<(), delaywheel::redis::QueueError> {
//! // A namespace of its own: a `Persistent` engine and a queue on one namespace would
//! // take each other's tasks.
//! let cfg = QueueConfig::new("redis://127.0.0.1/", "order-queue");
//! let consumer = Consumer::start(cfg.clone(), Handlers::new().on("order.close", |task| {
//!     println!("closing {}", task.payload["order_id"]);
//!     Ok(())
//! }))?;
//! let producer = Producer::connect(cfg).await?;
//! producer.enqueue("order:42", "order.close", serde_json::json!({ "order_id": 42 }),
//!     When::After(Duration::from_secs(1_800))).await?;
//! # consumer.shutdown(Duration::from_secs(5))?;
//! # Ok(())
//! # }
//! ```
//!
//! # Guarantees
//!
//! What each role promises, with the tests that check it (paths from the repository root;
//! `make test` runs them all, each Redis test against a `redis-server` of its own). Both roles
//! deliver at least once, so handlers must be idempotent: key them by task id (and by a
//! version where an id is reused), with [`Dedup`] or a conditional update
//! (`examples/order_timeout.rs`). The guarantees assume a Redis that keeps what it
//! acknowledged (`appendfsync always`, no asynchronous failover): see
//! [known limits](#known-limits).
//!
//! ## Persistence guarantees
//!
//! * **At-least-once.** A fired task leaves Redis only when [`Persistent::ack`] is given the
//!   task as it was received (an id replaced since by a version that fired too keeps that
//!   version until its own `ack`). A crash between the fire and the `ack` fires the task again
//!   after the next [`restore`](Persistent::restore). `tests/redis_persistent.rs`:
//!   `tasks_survive_a_restart_and_fire_once_each_at_their_due_tick` (100k tasks, each fired
//!   once at its due millisecond on manual clocks); `tests/persist_custom_store.rs`:
//!   `an_ack_of_a_replaced_version_leaves_the_new_one`,
//!   `a_replaced_task_is_not_delivered_by_the_timer_of_its_old_version`.
//! * **Nothing lost once written.** Under [`Durability::WriteBehind`] (the default) a crash
//!   loses at most the changes not yet written: the last
//!   [`flush_interval`](PersistConfig::flush_interval) (5 ms) while Redis answers, everything
//!   since it stopped answering while it does not (up to
//!   [`journal_bound`](PersistConfig::journal_bound) changes). [`Persistent::flush`] returns
//!   `true` only once everything journaled before the call is in Redis, and
//!   [`Persistent::shutdown`] flushes and hands back the tasks it could not write. A write
//!   that fails, or a store call that panics, puts its changes back into the journal, retried
//!   with backoff. `tests/persist_crash.rs`:
//!   `redis_sigkilled_mid_load_loses_nothing_while_the_wheel_keeps_firing`;
//!   `tests/redis_store.rs`: `acknowledged_writes_survive_a_sigkill_of_redis`;
//!   `tests/persist_custom_store.rs`: `the_store_matches_a_model_after_every_flush`
//!   (proptest), `a_failed_round_returns_what_it_did_not_send_and_later_cancels_reach_the_store`,
//!   `a_store_that_panics_is_retried_like_one_that_is_down`,
//!   `a_shutdown_with_the_store_down_hands_back_the_unwritten_tasks`;
//!   `tests/redis_persistent.rs`: `redis_down_bound_exceeded_refuses_and_the_flusher_catches_up`,
//!   `cancels_reach_a_redis_at_maxmemory_that_refuses_writes`.
//! * **Restore reads every row, across a Redis restart.** A restore pages by (due time, id),
//!   and each page names the server that read it (its `run_id`): a restart or a failover in
//!   the middle is noticed and the scan starts again, keeping what was loaded
//!   ([`RestoreReport::rescans`]), so no row is skipped. It keeps the version of a task the
//!   engine already holds, does not bring back a task cancelled or acknowledged while it runs,
//!   and moves broken rows to `{ns}:dead`. A Redis that comes back empty or with older data
//!   under a running engine is noticed at the next lease renewal, and the engine writes its
//!   whole pending set back (`delaywheel_store_data_loss_total`). `tests/persist_faults.rs`:
//!   `a_restore_across_a_redis_restart_loads_every_row`,
//!   `an_engine_writes_everything_back_after_redis_restarts_empty`,
//!   `an_engine_writes_everything_back_when_the_server_changes_with_part_of_the_data`,
//!   `before_a_restore_the_tasks_held_are_written_back_as_upserts`; `tests/redis_store.rs`:
//!   `pages_by_due_time_and_id_skip_nothing_in_runs_of_one_due_time`;
//!   `tests/persist_custom_store.rs`: `restore_does_not_bring_back_a_task_cancelled_meanwhile`,
//!   `restore_keeps_a_task_scheduled_again_and_a_cancel_still_removes_it`;
//!   `tests/redis_persistent.rs`: `restore_dead_letters_broken_entries_and_loads_the_rest`.
//! * **One writer per namespace.** An engine writes and restores its namespace only while it
//!   holds the writer lease `{ns}:engine` ([`PersistConfig::engine_lease`], 5 s, renewed every
//!   third of it). A new process's [`Persistent::start`] waits up to
//!   [`takeover_wait`](PersistConfig::takeover_wait) (30 s) for the old engine's `shutdown`,
//!   or after a crash for its lease to expire, so its restore reads everything the old one
//!   wrote; past the wait, `start` fails with [`PersistError::EngineRunning`]. An engine takes
//!   a lapsed lease back only if no other engine took it meanwhile; one that lost it to another
//!   writes nothing again and refuses `schedule` with [`PersistError::LeaseLost`], and Redis
//!   refuses its removals and snapshot swap. [`Persistent::is_writing`] and the
//!   `delaywheel_persist_writing` gauge are the signal to alert on. `tests/redis_persistent.rs`:
//!   `a_new_engine_waits_for_the_old_ones_shutdown_and_restores_its_last_tasks`,
//!   `start_waits_for_a_held_lease_at_most_takeover_wait`,
//!   `an_engine_that_lost_its_lease_writes_nothing_again`,
//!   `a_lapsed_lease_is_taken_back_unless_another_engine_held_it_meanwhile`.
//! * **Write-through and confirmed removals.** Under [`Durability::WriteThrough`],
//!   `schedule` returns once Redis has the task (or, past an optional
//!   [`write_through_timeout`](PersistConfig::write_through_timeout),
//!   [`PersistError::Unconfirmed`]: scheduled and journaled, not yet confirmed). `cancel` and
//!   `ack` stay write-behind under both modes: a crash right after one can bring the task
//!   back, to fire again. [`Persistent::cancel_confirmed`] and [`Persistent::ack_confirmed`]
//!   return once Redis has the removal, so a crash after them cannot. `tests/persist_crash.rs`:
//!   `write_through_acknowledged_ids_survive_a_sigkill_of_the_process` (a child process
//!   SIGKILLed at a random moment keeps every acknowledged id),
//!   `confirmed_cancels_survive_a_sigkill_of_the_process`; `tests/redis_persistent.rs`:
//!   `write_through_returns_once_redis_has_the_task`; `tests/persist_custom_store.rs`:
//!   `write_through_with_a_timeout_reports_an_unconfirmed_task_that_still_lands`,
//!   `write_through_that_shutdown_interrupts_is_handed_back_once`.
//!
//! ## Queue guarantees
//!
//! * **At-least-once, under leases and fencing tokens.** A claim moves tasks to a lease owned
//!   by `consumer|token` (a fresh token per claim); every later ack, retry or dead-lettering
//!   checks that owner, so a consumer whose lease was taken over cannot ack over the new
//!   owner. A claim whose reply was lost is answered again by its retry (same nonce), so its
//!   tasks fire on time, not a lease later. [`Producer::enqueue`] is idempotent by id.
//!   `tests/queue.rs`: `four_consumers_fire_each_of_50k_tasks_exactly_once`,
//!   `a_stalled_consumers_late_ack_is_refused_by_the_fencing_token`,
//!   `a_claim_whose_reply_was_lost_fires_its_batch_on_time`,
//!   `replace_swaps_a_pending_task_and_a_claimed_copy_can_no_longer_ack`,
//!   `a_reclaimed_id_fires_once_with_its_newest_version`,
//!   `leases_of_running_and_waiting_tasks_are_renewed`,
//!   `an_enqueue_whose_reply_is_lost_is_not_sent_again`,
//!   `an_enqueue_redis_fails_hands_the_envelope_back`; `tests/queue_wake.rs`:
//!   `a_task_enqueued_ahead_is_claimed_by_the_wake_up_or_the_next_reconcile`.
//! * **Retries with backoff, then dead letters.** A failed attempt (an `Err`, a panic, an
//!   unknown topic, a payload a typed handler cannot decode) is retried after the
//!   [`RetryPolicy`]'s backoff (attempt² s, at most 5 attempts, by default), then goes to
//!   `{ns}:dead` with the reason, the time and the attempt count, where
//!   [`Producer::dead_letters`] lists it and [`Producer::requeue`] puts it back. A task whose
//!   lease runs out [`max_lease_expiries`](QueueConfig::max_lease_expiries) times (3: it
//!   takes its consumers down) is dead-lettered too. `tests/queue.rs`:
//!   `failures_follow_the_backoff_then_dead_letter_and_requeue_works`,
//!   `poison_tasks_are_dead_lettered_with_reasons_and_the_consumer_goes_on`,
//!   `exponential_backoff_doubles_within_its_jitter_and_caps`,
//!   `a_task_that_crashes_its_consumers_is_dead_lettered_after_max_lease_expiries`.
//! * **A crashed, stalled or stuck consumer hands its tasks on.** Expired leases go back to the
//!   queue through every consumer's reaper. A consumer whose handler threads are all stuck,
//!   each in one handler for [`handler_stall`](QueueConfig::handler_stall) (10 s), hands every
//!   task it holds back at once (other consumers fire them on time) and claims nothing until
//!   a thread is free; a hand-back Redis refuses is tried again. `tests/queue.rs`:
//!   `a_crashed_consumers_tasks_fire_elsewhere_after_the_lease`,
//!   `a_reaper_round_returns_every_expired_lease`,
//!   `the_reaper_loses_no_task_whose_stored_state_is_broken`,
//!   `a_consumer_whose_handlers_are_stuck_hands_its_tasks_to_another`,
//!   `a_refused_stall_hand_back_is_tried_again`.
//! * **Shutdown hands back.** [`Consumer::shutdown`] hands the claimed, unfired tasks back at
//!   once, lets running handlers finish within its timeout and sends their acks; tasks still
//!   waiting for a handler when the timeout ends are handed back too, not run. It returns
//!   within about the timeout even while Redis hangs. `tests/queue.rs`:
//!   `graceful_shutdown_hands_claimed_tasks_back_at_once`,
//!   `shutdown_lets_a_running_handler_finish_and_sends_its_ack`,
//!   `shutdown_runs_tasks_already_fired_and_queued_for_a_busy_handler`,
//!   `a_shutdown_that_times_out_hands_back_tasks_waiting_for_a_handler`,
//!   `shutdown_keeps_its_timeout_while_redis_hangs`.
//! * **`async` handlers keep the same guarantees** ([`Handlers::on_async`],
//!   [`Handlers::on_async_typed`], feature `tokio`): at most
//!   [`handler_threads`](QueueConfig::handler_threads) run at once with the thread handlers,
//!   leases are renewed while a future runs, every slot stuck means the stall hand-back, an
//!   `Err` or a panic is a retry, and `shutdown` waits for running futures until its timeout,
//!   then drops them and hands their tasks back. `tests/queue_async.rs`:
//!   `an_async_handler_runs_on_the_applications_runtime_with_a_typed_payload`,
//!   `async_handlers_on_the_consumers_runtime_run_at_most_handler_threads_at_once`,
//!   `async_and_typed_handler_failures_are_retried_then_dead_lettered`,
//!   `the_lease_of_a_running_future_is_renewed`,
//!   `a_consumer_whose_async_handlers_are_stuck_hands_its_tasks_to_another`,
//!   `shutdown_waits_for_running_futures_then_hands_back_the_rest`,
//!   `a_handler_runtime_that_shuts_down_fails_the_attempts_and_loses_nothing`.
//! * **A slow shard delays no other.** Each shard has its own claim loop and reaper, and its
//!   acks, renewals and hand-backs go out as calls of their own. `tests/queue.rs`:
//!   `a_paused_node_delays_no_other_shards_tasks`, `a_paused_node_delays_no_other_shards_reaping`,
//!   `a_paused_node_delays_no_other_shards_acks`,
//!   `a_paused_node_delays_no_other_shards_renewals`,
//!   `a_paused_node_keeps_back_no_other_shards_hand_back`,
//!   `the_queue_spreads_over_a_redis_cluster`.
//!
//! # Persistence: the journal, the flusher and restore
//!
//! The engine's wheel is the source of truth. Every change goes into a journal that keeps the
//! last change per task id, so once a restore has completed, a task scheduled and cancelled
//! within one flush window costs no Redis command. The flusher writes the journal every
//! [`flush_interval`](PersistConfig::flush_interval) in atomic batches of
//! [`batch`](PersistConfig::batch), removals first and never in one batch with writes: a Redis
//! at `maxmemory` refuses every write (and every MULTI) but still runs a batch of removals, so
//! cancels and acks reach it and free its memory. While Redis is down the engine keeps
//! scheduling and firing; the journal takes new tasks while it holds fewer than
//! `journal_bound` unflushed changes (cancels, acks and a restore's corrections count, and
//! are journaled past it: refusing them would lose them), retrying with backoff from
//! `flush_interval` doubling up to 1 s; then [`WhenFull::Block`] makes producers wait or
//! [`WhenFull::Error`] refuses with the envelope handed back (a warning and
//! `delaywheel_journal_full_total` say so). Envelopes over
//! [`max_envelope`](PersistConfig::max_envelope) bytes are refused at once with
//! [`PersistError::Envelope`], which hands the envelope back.
//!
//! [`Persistent::restore`] fires overdue tasks at once, or with [`Overdue::RateLimited`] at
//! most N per second. Until a restore has completed, a `cancel` of an id not held in memory
//! still removes it from Redis and keeps the restore from loading it (unless the journal is
//! at its bound). [`Persistent::snapshot`] rewrites the whole pending set and swaps it in
//! atomically, so Redis then matches memory exactly; it needs a completed restore (without
//! one it returns `None`: it would delete rows no restore has read). A flush batch that meets
//! a key of the wrong type is taken back whole and retried, with an error log naming the key
//! and `delaywheel_store_wrong_type_total`.
//!
//! [`RedisStore`] writes a batch as one MULTI/EXEC of multi-member `ZADD`/`HSET`/`ZREM`/`HDEL`
//! (the last operation per id wins), and a batch of removals only as one Lua script, as
//! atomic, which Redis runs also at `maxmemory`. It reads a restore's pages with a read-only
//! script, never one giant reply, and sorts out entries with no envelope, an undecodable
//! envelope, a score that is not an integer time, an empty id, or an envelope that names
//! another id: they go to `{ns}:dead` with the reason. Another backend implements
//! [`TaskStore`] (`tests/persist_custom_store.rs` runs the engine on an in-memory one).
//!
//! # The queue: claims, leases and retries
//!
//! A claim moves up to [`batch`](QueueConfig::batch) tasks due within
//! [`lookahead`](QueueConfig::lookahead) (2 s) from the queue to a lease of
//! `max(due, now) + `[`lease`](QueueConfig::lease) (30 s), on Redis's clock: the scripts that
//! set, renew and expire leases read `TIME`, so consumers whose clocks disagree still agree
//! on when a lease ends. The consumer keeps its claim's nonce after a failed claim, and the
//! script keeps the last claim in `{ns}:batch:<consumer>:<instance>` until its leases end, so
//! a retried claim is answered from it instead of claiming more. Producers PUBLISH a wake-up
//! for tasks due before the next reconcile claim (every [`reconcile`](QueueConfig::reconcile),
//! 1 s, jittered to 80–100% per shard), so a lost notification delays a task by at most that
//! interval. A consumer renews, every `lease / 3`, the leases of the tasks it works on
//! (waiting for a handler, running, or with an outcome not yet written), so a slow handler or
//! a backlog keeps its tasks while the consumer lives; one that crashes or stalls stops
//! renewing, and its tasks fire elsewhere after the lease. Dropping a consumer without
//! `shutdown` is [`Consumer::abort`]: nothing handed back, its leases expire.
//!
//! [`Dedup::begin`] takes a `running` marker (`SET NX … GET`, with a lease and a random token),
//! [`Dedup::finish`] sets `done` for a long TTL, and [`Dedup::abandon`] drops only its own
//! marker. Its calls are async: await them from an `async` handler, or from a thread handler
//! through a Tokio runtime the application owns. Keep its lease below the time the retry
//! policy spans (30 s with the defaults). `enqueue` of a pending id leaves it alone
//! (`enqueue_envelope(envelope, true)` replaces it); [`Producer::requeue`] of a dead letter
//! whose id is pending again is refused ([`QueueError::StillPending`]). An `enqueue` that
//! Redis fails hands the envelope back ([`QueueError::NotEnqueued`]; the task may be queued
//! all the same if only the reply was lost, and enqueueing it again is harmless).
//!
//! # Connections and Redis Cluster
//!
//! URLs: `redis://user:password@host:port/db`, `redis+unix:///path?user=..&pass=..`, and with
//! feature `tls` `rediss://` (certificates verified against the system's trust store;
//! `SSL_CERT_FILE` works). [`PersistConfig::cluster_nodes`] and
//! [`QueueConfig::cluster_nodes`] (and [`Dedup::connect_cluster`]) take a Redis Cluster's seed
//! nodes. A namespace is one slot, so each flusher batch is still one MULTI/EXEC on the node
//! that owns it. A queue with [`shards`](QueueConfig::shards) `= N > 1` has N key sets
//! `{ns:0}:…` … `{ns:N-1}:…` (and the one `{ns}:wake` channel), a task going to shard
//! [`shard_of`]`(id, N)` (FNV-1a), so its backlog and claim load spread over N slots; each
//! consumer claims from all shards or from its
//! [`assigned_shards`](QueueConfig::assigned_shards). Wake-ups are subscribed on one node.
//!
//! A cluster command is sent again, at most twice, 50 and 100 ms apart, only after a refusal
//! that says it did not run (`MOVED`, `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`,
//! `READONLY`, or no connection to send it on), never after a timeout or a dropped connection,
//! when it may have run: that error goes to the caller. A MULTI refused whole with such codes
//! is sent again the same way, after a command on its first key has refreshed the slot map.
//! `ASK` (a slot in mid-migration) is not followed: the call fails, and the loops and the
//! flusher retry it with their backoff. [`Producer::connect`] must be called inside a Tokio
//! runtime with time and I/O enabled (else it returns an error); [`Persistent`] and
//! [`Consumer`] run their own.
//!
//! # Key layout
//!
//! Every key of a namespace shares the hash tag `{ns}`, so a namespace lives in one Redis
//! Cluster slot and multi-key transactions on it are allowed:
//!
//! | key | type | content |
//! |---|---|---|
//! | `{ns}:due` | ZSET | member = task id, score = due time in ms since the Unix epoch |
//! | `{ns}:tasks` | HASH | task id → the JSON [`Envelope`] |
//! | `{ns}:dead` | HASH | task id → JSON `{ "reason", "raw", "at", "attempt" }` of an entry that could not be used (`raw`: the envelope; [`Persistent`] keeps one that is not UTF-8 in `raw_hex` (and `raw` is `null`), the queue in `raw` with those bytes replaced by U+FFFD, or by its reaper as Lua's cjson writes them; with no envelope, `null` from [`Persistent`] and `""` from the queue's scripts; `attempt`: queue only) |
//! | `{ns}:lease` | ZSET | queue: claimed task id → lease deadline in ms (Redis's clock) |
//! | `{ns}:owner` | HASH | queue: claimed task id → `consumer|token` (the fencing token) |
//! | `{ns}:fence` | STRING | queue: the counter of fencing tokens |
//! | `{ns}:batch:<consumer>:<instance>` | LIST | queue: a consumer's last claim on the shard (`<instance>` is random per [`Consumer::start`]), `nonce, token, id1, due1, …`, expiring when the last of its leases ends: a claim retried with that nonce (its reply was lost) is answered from it |
//! | `{ns}:expired` | HASH | queue: task id → how many times a lease on it ran out |
//! | `{ns}:unpaired` | HASH | queue: task id → when (ms, Redis's clock) it was first seen half written: queued with no envelope (by a claim), or an envelope with no queue entry (by a reaper's sweep); struck out when the task is whole or gone (see [`QueueConfig::unpaired_grace`]) |
//! | `{ns}:kind` | STRING | the role using the namespace, `persistent` or `queue` (set by the first to connect; the other is refused with [`NamespaceInUse`]) |
//! | `{ns}:engine` | STRING | [`Persistent`]'s writer lease: the name of the one engine that writes and restores the namespace (see [`PersistConfig::engine_lease`]) |
//! | `{ns}:engine:takes` | STRING | `<count> <name>`: how many times that lease was taken while free, and by whom last |
//! | `{ns}:done:<id>` | STRING | [`Dedup`] marker: `running:<token>` (lease TTL) or `done` (keep TTL) |
//! | `{ns:limit:<topic>}:rate` | STRING | queue: a topic's rate limit, the GCRA's theoretical arrival time (ms, Redis's clock; see [`TopicLimit`]) |
//! | `{ns:limit:<topic>}:running` | ZSET | queue: a topic's concurrency slots, `<consumer>:<instance>:<n>` → lease deadline (ms, Redis's clock) |
//! | `{ns}:wake` | pub/sub channel | queue: wake-ups (a due time in ms, and on a sharded queue `:` and the shard) |
//! | `{ns}:due:snapshot:<engine>`, `{ns}:tasks:snapshot:<engine>` | ZSET, HASH | [`Persistent::snapshot`]'s scratch copy (no `:<engine>` without a lease), renamed over `{ns}:due` and `{ns}:tasks` |
//!
//! Scores are integers below 2^53, so a double holds them exactly.
//!
//! # Producers in other languages
//!
//! A queue task is two writes on its shard's keys (`{ns}` for one shard; with `shards = N`,
//! `{ns:i}` where `i` is [`shard_of`]`(id, N)`): its envelope in `{ns}:tasks` (a JSON
//! [`Envelope`]: `id`, `topic`, `payload` and `due_at` are required, `attempt` and
//! `created_at` may be left out) and its id in `{ns}:due`, scored by its due time (integer ms
//! since the Unix epoch, the same as `due_at`). A producer that writes them itself should, in
//! order of preference:
//!
//! 1. call the ENQUEUE script, the one [`Producer::enqueue`] runs (its text is
//!    [`Producer::ENQUEUE_SCRIPT`]: `SCRIPT LOAD` it once and call `EVALSHA`). It writes
//!    both at once, leaves a pending id alone, and wakes the consumers:
//!    * KEYS: `{ns}:due`, `{ns}:tasks`, `{ns}:lease`, `{ns}:owner`, `{ns}:expired`.
//!    * ARGV: the id; the due time (ms); the envelope (JSON); `1` to replace a pending task of
//!      that id, else `0`; the wake-up channel `{ns}:wake` (the namespace without a shard
//!      suffix, for every shard); publish a wake-up if the due time is before this (ms; `0`:
//!      never; [`Producer`] uses now + `reconcile` + `claim_margin`); the wake-up message
//!      (the due time, followed on a sharded queue by `:` and the shard, e.g.
//!      `1733234567890:3`).
//!    * Reply: `1` if stored, `0` if a task of that id was pending (an envelope, and queued
//!      or claimed) and `0` was given for replace.
//! 2. or send `HSET {ns}:tasks` and `ZADD {ns}:due` in one MULTI/EXEC (this overwrites a
//!    pending task of the same id, and publishes no wake-up: consumers then find the task at
//!    their next reconcile claim, within `reconcile`);
//! 3. or write the envelope first, then the ZADD.
//!
//! A task written in two steps is half written in between, and the consumers tolerate that
//! for [`QueueConfig::unpaired_grace`] (5 s by default), counted from when they first see it:
//! an id queued with no envelope is left queued (not claimed) and dead-lettered once that
//! has passed (reason `no envelope in the tasks hash`); an envelope with no queue entry is
//! removed once it has passed. Either way, both writes must land within the grace period.
//! An envelope with no queue entry does not make its id pending: [`Producer::enqueue`]
//! stores a new task under that id.
//!
//! # Metrics
//!
//! Published through the `metrics` facade (install the recorder before starting anything).
//! The engine's own series are listed at
//! [`TimerBuilder::metrics_interval`](crate::TimerBuilder::metrics_interval).
//!
//! * [`Persistent`]: `delaywheel_journal_depth`, `delaywheel_flush_lag_seconds`,
//!   `delaywheel_flushed_ops_total`, `delaywheel_flush_failures_total`,
//!   `delaywheel_journal_full_total`, `delaywheel_persist_writing` (1 or 0, see
//!   [`Persistent::is_writing`]), `delaywheel_store_data_loss_total`,
//!   `delaywheel_store_wrong_type_total` (labelled `key`).
//! * The queue, by one scheme: `delaywheel_queue_<what>`, `_total` for a counter, `_seconds`
//!   for a time; labels `namespace`, `shard` (per shard) and `topic` (per topic: the topics
//!   with a registered handler, and `unknown` for any other, so the label set is bounded).
//!
//! | name | type | unit | labels | what |
//! |---|---|---|---|---|
//! | `delaywheel_queue_processed_total` | counter | tasks | namespace, topic | handler runs that succeeded |
//! | `delaywheel_queue_failed_total` | counter | tasks | namespace, topic | handler runs that failed (an error, a panic, an undecodable typed payload) |
//! | `delaywheel_queue_retried_total` | counter | tasks | namespace, topic | failures put back with a backoff |
//! | `delaywheel_queue_dead_lettered_total` | counter | tasks | namespace, topic | failures past `max_attempts` |
//! | `delaywheel_queue_handler_duration_seconds` | histogram | s | namespace, topic | a handler's run, or an `async` handler's future |
//! | `delaywheel_queue_latency_seconds` | gauge | s | namespace, shard | age of the oldest due task not claimed (0 if none) |
//! | `delaywheel_queue_paused` | gauge | 0/1 | namespace, shard | 1 while claims find the queue [paused](Producer::pause) |
//! | `delaywheel_queue_depth`, `_leased`, `_dead` | gauge | tasks | namespace, shard | queued, claimed, dead-lettered |
//! | `delaywheel_queue_fired_total` | counter | tasks | | timers fired to handlers |
//! | `delaywheel_queue_lateness_seconds` | histogram | s | | fire time − due time |
//! | `delaywheel_queue_claim_batch` | histogram | tasks | | tasks per claim |
//! | `delaywheel_queue_redis_commands_total` | counter | commands | | every command sent |
//! | `delaywheel_queue_commands_per_fired_task` | gauge | ratio | | commands ÷ fired, since start |
//! | `delaywheel_queue_lease_recovered_total` | counter | tasks | | expired leases put back by the reaper |
//! | `delaywheel_queue_leases_renewed_total` | counter | leases | | lease renewals |
//! | `delaywheel_queue_acks_refused_total` | counter | acks | | acks refused: the lease was taken over |
//! | `delaywheel_queue_given_back_total` | counter | tasks | | tasks handed back (stall, shutdown) |
//! | `delaywheel_queue_unpaired_removed_total` | counter | tasks | | half-written tasks swept |
//! | `delaywheel_queue_wrong_type_total` | counter | events | key | a key of the wrong type met |
//!
//! The per-shard gauges come from the reaper, every `reaper_interval`, one pipeline per shard
//! (no per-task command). Every consumer serving a shard reports the same reading: aggregate
//! them across replicas with `max by (namespace, shard)`, never `sum`. The counters are each
//! consumer's own: `sum` them. [`Consumer::stats`] has the same counts in-process.
//!
//! # Known limits
//!
//! Each is a lateness or a duplicate, not a silent loss.
//!
//! * **Durable Redis.** The guarantees assume Redis keeps what it acknowledged
//!   (`appendfsync always`, as the persistence tests run it, and no asynchronous failover). A
//!   [`Persistent`] engine repairs a Redis that lost its data only at its next lease renewal
//!   (every `engine_lease / 3`, 1.7 s by default): a crash of the engine within that window
//!   loses what Redis lost. Before a restore has completed the repair is upserts only, so a
//!   row a lagging replica kept of a task cancelled since stays, and fires after the next
//!   restart.
//! * **Persistence, one engine per namespace.** A deploy whose new process must be ready before
//!   the old one stops (Kubernetes' default rolling update waits for readiness) must not make
//!   readiness wait for [`Persistent::start`], or must stop the old process first. An engine
//!   that lost its lease to another writes nothing again (restart it), and both engines fire
//!   what both loaded, as at-least-once allows; a batch of writes already on its way when the
//!   lease lapsed can still land. For many instances sharing tasks, use the queue.
//! * **Persistence, clock steps.** A due time is wall-clock epoch ms; it becomes a deadline on
//!   the monotonic clock when the task is scheduled or restored. A later step of the wall
//!   clock (an NTP step, a VM resumed from a snapshot) does not move armed tasks: they fire
//!   off their due time by the step (early for a backwards step) until a restart re-arms them.
//!   Tasks scheduled after the step use it within a second. A host that suspends stops the
//!   monotonic clock on Linux, so armed tasks fire late by the suspension.
//! * **Persistence while Redis is down.** `WriteThrough` waits without a limit (until
//!   `shutdown`) unless `write_through_timeout` is set. Retry rounds are probes of one batch;
//!   the first failed round puts the whole journal back (tens of ms per 100k changes, once per
//!   outage), and a failed snapshot is retried on a backoff of its own (20 ms doubling to
//!   10 s) with journal rounds in between. Callers waiting in `flush` or a `WriteThrough`
//!   `schedule` do not cut the backoff short: after Redis comes back they wait up to 1 s.
//! * **Queue, pausing and inspecting.** [`Producer::pause`] pauses the whole queue (every
//!   shard), not one topic: the claim script would have to step over a paused topic's tasks
//!   without scanning, which needs an index per topic. Tasks claimed before a pause fire (at
//!   most those due within `lookahead`). Depths and latency are per shard; per topic the queue
//!   keeps only outcome counts ([`Producer::topic_counts`]), written by each consumer every
//!   `reaper_interval`: no script that moves a task reads its topic. The `delaywheel
//!   dashboard` counts each topic's queued, leased and dead tasks and its latency by walking
//!   the queue with [`Producer::list`], at most `--census-rate` tasks a second (10 000 by
//!   default: a pass over a million tasks takes 100 s), and shows the last complete pass.
//! * **Queue, limits.** Every consumer of a namespace is to carry the same [`TopicLimit`]s:
//!   each limiter call carries its caller's. A start is counted at its slot: one that finds
//!   every handler thread busy starts later, so starts can bunch past the limit while the
//!   handler threads are saturated (give a limited topic threads to spare). Slots booked by a
//!   consumer that then crashed, or handed its tasks back, go unused (fewer starts, never
//!   more). Per topic, not per task (no keys per tenant).
//! * **Queue, clocks.** A task fires when the consumer's wall clock reaches its due time,
//!   which the producer's clock set: a consumer whose clock runs ahead fires early by the
//!   difference. Leases run on Redis's clock. Keep the hosts on NTP.
//! * **Queue, expiries that were not crashes.** `max_lease_expiries` counts every lease that
//!   ran out, also those no handler crashed (a claim reply lost and never retried, tasks a
//!   consumer could not arm, a claim cut off by a shutdown's timeout, a failed hand-back), and
//!   a retry or a hand-back does not reset the count: a task may be dead-lettered without
//!   having run. Set the limit with that in mind, or to 0 (no limit). A task dead-lettered
//!   under an id that already has a dead letter replaces it.
//! * **Queue, a lost claim reply.** Its tasks are late by the retry's backoff; if the consumer
//!   stops before it retries, they wait out their lease and fire elsewhere. The batch answered
//!   again is taken whole, so `max_held` can be passed by up to one batch.
//! * **Queue, hung handlers.** A handler that never returns keeps its own task (its lease
//!   renewed) for as long as its consumer lives. [`Consumer::shutdown`] from one of its own
//!   handlers waits for that handler, itself, until the timeout. A claim whose reply is still
//!   out when `shutdown` stops the claim loops is not handed back: its tasks wait for their
//!   leases.
//! * **Queue on a Redis Cluster.** Producers and consumers load every script on every node; a
//!   node that restarted without its script cache answers `NOSCRIPT`, and the reload goes to
//!   every node, so while any node does not answer, the restarted node's shards make no
//!   progress (nothing is lost). The outcomes a consumer holds for writing are bounded in all
//!   (65 536), not per shard: a node that stays hung while that many pile up for it makes
//!   every shard's handlers wait.
//! * **One key space per role.** A queue and a [`Persistent`] engine on one namespace would
//!   take each other's tasks, so the first to connect claims it in `{ns}:kind` and the other
//!   is refused ([`QueueError::InUse`], [`PersistError::InUse`]), also when the namespace holds
//!   the other role's keys or a key of the wrong type (the error names it). The claim is
//!   checked at start only, skipped with a warning when Redis does not answer it within 2 s
//!   or refuses it (an ACL user without `EVAL` or `SET` on the key), and never released:
//!   delete `{ns}:kind` once nothing of the first role uses the namespace. A queue namespace
//!   ending in `:` and digits (a sharded queue's keys) is refused with
//!   [`QueueError::Namespace`].
//! * **[`Dedup`]** uses `SET NX … GET`, which needs Redis 7.0 or later.
//!
//! # Testing
//!
//! Each Redis test starts its own `redis-server` from `PATH` on a Unix socket in a temp dir
//! (and fails with install instructions when there is none): the persistence tests with
//! `appendfsync always`, including a SIGKILL and restart of the server, the queue tests mostly
//! without an append-only file, and the cluster tests (`tests/redis_persistent.rs`,
//! `tests/queue.rs`) on a 3-node Redis Cluster over TCP. Besides the tests named under
//! [Guarantees](#guarantees): `tests/namespace_claim.rs` (starts refuse wrong-typed keys and
//! the other role's keys, and claim nothing), `tests/queue_faults.rs` (a producer in another
//! language writing a task in two steps, an orphan envelope, envelopes without `attempt` or
//! `created_at`, a wrong-typed dead-letter key), `tests/typed_payloads.rs`, `tests/when.rs`,
//! `tests/redis_tls.rs` (feature `tls`) and `tests/metrics.rs`. The doc examples that run do so
//! against the server named by `DELAYWHEEL_TEST_REDIS`, which `make test` starts.

mod blocking;
mod envelope;
mod layout;
mod link;
mod payload;
mod persist;
mod queue;
mod store_error;
mod trace_context;
mod wall_clock;
mod when;

pub use envelope::{Envelope, EnvelopeError, Headers, MAX_DUE_MS, MAX_PAYLOAD_DEPTH};
pub use layout::{KeyLayout, NamespaceError, NamespaceInUse};
pub use payload::{IntoPayload, PayloadError};
#[cfg(feature = "futures")]
#[cfg_attr(docsrs, doc(cfg(feature = "futures")))]
pub use persist::FiredStream;
pub use persist::{
    Broken, BrokenReason, Cursor, Durability, Lease, Op, Overdue, Page, PersistConfig,
    PersistError, Persistent, RedisStore, RestoreReport, Row, Rows, TaskStore, WhenFull, MAX_PAGE,
};
pub use queue::{
    shard_of, Backoff, Begin, Claim, Consumer, DeadTask, Dedup, DedupError, HandlerError, Handlers,
    ListCursor, ListState, Producer, QueueConfig, QueueDepth, QueueError, QueueStats, Rescheduled,
    RetryPolicy, ShardStats, TaskInfo, TaskPage, TaskState, TopicCounts, TopicLimit, Unique,
    MAX_UNIQUE_WINDOW,
};
#[cfg(feature = "periodic")]
#[cfg_attr(docsrs, doc(cfg(feature = "periodic")))]
pub use queue::{CatchUp, Every, Periodic, PeriodicError, Scheduler};
pub use store_error::StoreError;
pub use wall_clock::{now_ms, WallClock};
pub use when::When;

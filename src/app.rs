//! Builds the whole service from [`Settings`] and runs it: the API, the
//! store writer and the background samplers, under one shutdown signal.
//!
//! Tests build an [`Application`] on port 0 with a temporary database and
//! drive it over real HTTP.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::accept::Acceptor;
use crate::accept::outbox::Outbox;
use crate::api::auth::AdminAuth;
use crate::api::{self, AppInner, AppState};
use crate::config::{LimitsBackend, QueueBackend, Settings};
use crate::consumer::{ChannelProviders, Delivery, GatedProvider, LaneConsumer, PoolMember};
use crate::limits::admission::TenantLimits;
use crate::limits::backpressure::{LaneBackpressure, PendingCounts};
use crate::limits::gate::{MemberSpec, ProviderGate};
use crate::limits::redis::RedisLimits;
use crate::limits::tenant::SentCounts;
use crate::model::{Channel, Lane, TenantStatus, World};
use crate::queue::embedded::EmbeddedQueue;
use crate::queue::postgres::PgLanes;
use crate::queue::sqs::SqsQueue;
use crate::queue::{LaneQueue, TenantQueues};
use crate::store::{Db, Staging, Writer};
use crate::tenants::Registry;

/// Longest wait for the accept writer to commit what is left at shutdown.
const WRITER_DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the API keys' last uses noted in memory are written to the
/// store.
const KEY_USE_WRITES: Duration = Duration::from_secs(60);

pub struct Application {
    listener: TcpListener,
    state: AppState,
    shutdown: watch::Sender<bool>,
    background: Vec<JoinHandle<()>>,
    /// The store's one writer, stopped last.
    store_writer: Writer,
    /// Completes once the store writer has committed all it was given.
    writer_task: tokio::sync::oneshot::Receiver<()>,
    /// One per lane when `consumers.enabled`; started by `run_until`.
    consumers: Vec<Arc<LaneConsumer>>,
    /// SQS mode: completes once the outbox has recorded its last sends.
    outbox_task: Option<JoinHandle<()>>,
}

impl Application {
    /// Opens the store and the queue, binds the listener and starts the
    /// background tasks. Nothing is served until [`Application::run_until`].
    pub async fn build(settings: Settings) -> anyhow::Result<Self> {
        let settings = Arc::new(settings);
        // First, so that start-up (queue set-up, first samples) is counted.
        let metrics = crate::metrics::install(&settings.instance_name());
        let db = Db::connect(&settings.storage.url, settings.storage.fsync).await?;
        info!(store = db.kind(), "Store opened.");
        let registry = Arc::new(Registry::load(db.clone(), &settings.plans).await?);
        registry.set_retention_default(settings.retention.default_days);
        let admin = AdminAuth::init(&db, &settings).await?;
        let (shutdown, shutdown_rx) = watch::channel(false);
        // Other instances' registry changes and admin token rotations.
        let rotations = admin
            .clone()
            .follow_rotations(db.clone(), shutdown_rx.clone());
        let follow = registry.clone().follow(shutdown_rx.clone());
        let mut background = vec![tokio::spawn(follow), tokio::spawn(rotations)];
        release_interrupted_sends(&db).await?;
        let (store_writer, writer_task) = Writer::start(
            &db,
            settings.storage.max_group,
            settings.storage.max_size_mb,
        )?;
        let Lanes {
            queue,
            tenant_queues,
            staging,
            outbox,
            outbox_task,
        } = open_lanes(
            &settings,
            &db,
            &registry,
            &store_writer,
            &mut background,
            &shutdown_rx,
        )
        .await?;
        store_writer.stage_into(staging)?;
        let backpressure = lane_backpressure(&settings, &db, outbox.is_some());
        let relay = outbox.as_ref().map(|outbox| outbox.health());
        let redis = limits_in_redis(&settings, &db, &mut background, &shutdown_rx).await?;
        background.push(sample_lanes(&backpressure, &queue, &shutdown_rx).await);
        spawn_jobs(
            &settings,
            &db,
            &registry,
            &store_writer,
            &tenant_queues,
            &mut background,
            &shutdown_rx,
        )
        .await?;
        let delivery = match settings.consumers.enabled {
            true => {
                let queues = (&queue, &tenant_queues);
                Some(delivery(&settings, &db, &registry, queues, &store_writer, &redis).await?)
            }
            false => None,
        };
        let (consumers, providers) =
            start_consumers(&settings, delivery, &mut background, &shutdown_rx);
        let listener = TcpListener::bind(settings.server.listen)
            .await
            .with_context(|| format!("binding {}", settings.server.listen))?;
        let unsubscribe = unsubscribe_links(&settings, &db).await?;
        let accept = acceptor(&settings, &db, &store_writer, outbox, &redis, &backpressure)
            .with_unsubscribe(unsubscribe.clone());
        let (writes, uploads, reads) = request_limits(&settings, &redis);
        let state = AppState::new(AppInner {
            accept,
            redis,
            settings,
            console_key: crate::api::console::SessionKey::load(&db).await?,
            sign_ins: Default::default(),
            db,
            registry,
            queue,
            tenant_queues,
            writer: store_writer.clone(),
            backpressure,
            relay,
            writes,
            uploads,
            reads,
            admin,
            metrics,
            unsubscribe,
            providers,
        });
        Ok(Application {
            listener,
            state,
            shutdown,
            background,
            store_writer,
            writer_task,
            consumers,
            outbox_task,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    pub fn state(&self) -> AppState {
        self.state.clone()
    }

    /// Serves and delivers until `signal` completes; then stops taking
    /// requests and polling, returns buffered messages to their queue, lets
    /// requests and sends in flight finish (sends within
    /// `consumers.shutdown_grace_secs`), commits what the accept writer
    /// holds and closes the database.
    pub async fn run_until(
        self,
        signal: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let Application {
            listener,
            state,
            shutdown,
            background,
            store_writer,
            writer_task,
            consumers,
            outbox_task,
        } = self;
        let db = state.db.clone();
        let consumer_tasks: Vec<_> = consumers
            .into_iter()
            .map(|consumer| tokio::spawn(consumer.run(shutdown.subscribe())))
            .collect();
        let shutdown = Arc::new(shutdown);
        let trigger = shutdown.clone();
        tokio::spawn(async move {
            signal.await;
            let _ = trigger.send(true);
        });
        let stopping = shutdown.subscribe();
        let open_files = crate::serve::raise_open_file_limit();
        let server = &state.settings.server;
        let serve_limits = crate::serve::ServeLimits {
            header_read_timeout: Duration::from_secs(server.header_read_timeout_secs.max(1)),
            max_connections: crate::serve::connection_cap(server.max_connections, open_files),
            http2_max_streams: server.http2_max_streams,
        };
        let router = api::app(state);
        let served = crate::serve::serve(listener, router, serve_limits, stopping)
            .await
            .context("serving HTTP");
        let _ = shutdown.send(true);
        info!("HTTP server stopped; finishing background work.");
        for task in consumer_tasks {
            let _ = task.await;
        }
        served?;
        for task in background {
            let _ = task.await;
        }
        // Requests and consumers are done: the store writer commits what it
        // holds and stops; anything later is refused, not lost silently.
        store_writer.stop().await;
        if tokio::time::timeout(WRITER_DRAIN_TIMEOUT, writer_task)
            .await
            .is_err()
        {
            warn!("Store writer did not finish in time.");
        }
        if let Some(task) = outbox_task
            && tokio::time::timeout(WRITER_DRAIN_TIMEOUT, task)
                .await
                .is_err()
        {
            warn!("Outbox did not record its last sends in time; the next start re-sends them.");
        }
        db.close().await;
        info!("Shutdown complete.");
        Ok(())
    }
}

/// The tenant limits' day counts, read from the store.
struct StoredCounts(Db);

#[async_trait::async_trait]
impl SentCounts for StoredCounts {
    async fn sent_since(&self, tenant_id: &str, since_ms: i64) -> anyhow::Result<u64> {
        Ok(self.0.live_count_since(tenant_id, since_ms).await?)
    }
}

/// The SQS outbox's rows per lane, read from the store for the lanes'
/// backlog.
struct OutboxRows(Db);

#[async_trait::async_trait]
impl PendingCounts for OutboxRows {
    async fn pending(&self) -> anyhow::Result<[u64; 2]> {
        Ok(self.0.outbox_by_lane().await?)
    }
}

/// Starts the jobs that run beside the API and the consumers: unmatched
/// receipts tried again, the SES events queues read, webhooks dispatched,
/// retention, the usage roll-up (PostgreSQL) and expired idempotency keys
/// forgotten, the API keys' last uses written.
/// Samples the lanes' depths once, so the first requests see real ones,
/// then starts the sampler that keeps them current.
async fn sample_lanes(
    backpressure: &Arc<LaneBackpressure>,
    queue: &Arc<dyn LaneQueue>,
    shutdown: &watch::Receiver<bool>,
) -> JoinHandle<()> {
    let mut previous =
        [Lane::Fast, Lane::Slow].map(|lane| (queue.deleted_total(lane), std::time::Instant::now()));
    backpressure.sample(queue.as_ref(), &mut previous).await;
    tokio::spawn(backpressure.clone().run(queue.clone(), shutdown.clone()))
}

async fn spawn_jobs(
    settings: &Settings,
    db: &Db,
    registry: &Arc<Registry>,
    store_writer: &Writer,
    tenant_queues: &Arc<dyn TenantQueues>,
    background: &mut Vec<JoinHandle<()>>,
    shutdown_rx: &watch::Receiver<bool>,
) -> anyhow::Result<()> {
    background.push(tokio::spawn(
        registry
            .clone()
            .keep_key_uses(KEY_USE_WRITES, shutdown_rx.clone()),
    ));
    background.push(tokio::spawn(crate::receipts::retry_unmatched(
        db.clone(),
        store_writer.clone(),
        std::time::Duration::from_secs(settings.receipts.match_for_secs),
        shutdown_rx.clone(),
    )));
    // Each SES provider of the email pool may have its own events queue.
    for entry in settings.providers.pool(Channel::Email) {
        if let Some(poller) = crate::receipts::ses::EventsPoller::from_settings(
            entry.name,
            settings.logging.log_addresses,
            entry.settings,
            db.clone(),
            store_writer.clone(),
        )
        .await?
        {
            background.push(tokio::spawn(poller.run(shutdown_rx.clone())));
        }
    }
    let webhooks = crate::webhooks::dispatch::Dispatcher::new(
        db.clone(),
        store_writer.clone(),
        settings.webhooks.clone(),
    )
    .context("setting up the webhook dispatcher")?;
    background.push(tokio::spawn(webhooks.run(shutdown_rx.clone())));
    background.push(tokio::spawn(crate::scheduler::run_retention(
        crate::scheduler::Retention {
            db: db.clone(),
            registry: registry.clone(),
            queues: tenant_queues.clone(),
            batch: settings.retention.batch,
            vacuum: settings.retention.vacuum,
            audit_days: settings.retention.audit_days,
        },
        std::time::Duration::from_secs(settings.retention.interval_secs),
        shutdown_rx.clone(),
    )));
    // Each store does the upkeep its engine needs: usage deltas folded
    // where several instances count (PostgreSQL), the planner's statistics
    // refreshed where the store keeps them by hand (SQLite); the other
    // runs find nothing to do.
    background.push(tokio::spawn(crate::scheduler::roll_up_usage(
        db.clone(),
        shutdown_rx.clone(),
    )));
    background.push(tokio::spawn(crate::scheduler::purge_idempotency_keys(
        db.clone(),
        shutdown_rx.clone(),
    )));
    background.push(tokio::spawn(crate::scheduler::refresh_statistics(
        db.clone(),
        shutdown_rx.clone(),
    )));
    Ok(())
}

/// The embedded queue in the SQLite store: held tenants held again,
/// resumed ones' messages released, and every backlogged dedicated queue
/// signalled.
async fn open_embedded(
    settings: &Settings,
    db: &Db,
    registry: &Arc<Registry>,
    store_writer: &Writer,
) -> anyhow::Result<Lanes> {
    let (sqlite, sqlite_writer) = db.embedded_engine(store_writer)?;
    let embedded =
        Arc::new(EmbeddedQueue::open(sqlite, settings.lanes.clone(), sqlite_writer).await?);
    for tenant in registry.tenants() {
        if tenant.status != TenantStatus::Active {
            embedded.set_tenant_held(&tenant.id, true).await?;
        }
    }
    registry.route_isolation_to(embedded.clone());
    embedded
        .release_unheld()
        .await
        .context("releasing messages of resumed tenants")?;
    // Every dedicated queue with backlog has an attention
    // entry waiting (one lost with a crash is made again).
    embedded
        .reconcile_attention()
        .await
        .context("signalling dedicated tenant queues")?;
    Ok(Lanes {
        queue: embedded.clone(),
        tenant_queues: embedded.clone(),
        staging: Staging::Queue(embedded),
        outbox: None,
        outbox_task: None,
    })
}

/// What the lanes' consumers share: the store, the queues, each channel's
/// gated provider pool (and the simulated ones of test keys), the retry
/// policy and the status writer.
async fn delivery(
    settings: &Settings,
    db: &Db,
    registry: &Arc<Registry>,
    (queue, tenant_queues): (&Arc<dyn LaneQueue>, &Arc<dyn TenantQueues>),
    store_writer: &Writer,
    redis: &Option<Arc<RedisLimits>>,
) -> anyhow::Result<Delivery> {
    let share = settings
        .lanes
        .fast
        .low_priority_share
        .max(settings.lanes.slow.low_priority_share);
    Ok(Delivery {
        db: db.clone(),
        registry: registry.clone(),
        queue: queue.clone(),
        tenant_queues: tenant_queues.clone(),
        providers: channel_providers(settings, share, redis).await?,
        retry: settings.retry.clone(),
        consumers: settings.consumers.clone(),
        status: store_writer.clone(),
        delivering: Arc::default(),
        log_addresses: settings.logging.log_addresses,
        store_trouble: Default::default(),
        templates: Arc::new(crate::templates::Templates::new(db.clone())),
    })
}

/// The accept path: tenant limits (in memory, or in Redis), the accept
/// writer, the SQS outbox when there is one, and the lanes' backpressure.
fn acceptor(
    settings: &Settings,
    db: &Db,
    store_writer: &Writer,
    outbox: Option<Arc<Outbox>>,
    redis: &Option<Arc<RedisLimits>>,
    backpressure: &Arc<LaneBackpressure>,
) -> Acceptor {
    let limits = match redis.clone() {
        Some(redis) => TenantLimits::with_redis(Arc::new(StoredCounts(db.clone())), redis),
        None => TenantLimits::new(Arc::new(StoredCounts(db.clone()))),
    };
    Acceptor::new(
        db.clone(),
        store_writer.clone(),
        outbox,
        limits,
        backpressure.clone(),
        settings.server.max_batches_per_tenant,
    )
    .with_accept_deadline(Duration::from_millis(settings.server.accept_deadline_ms))
}

/// The limits of a tenant's requests other than sends: its changes and
/// uploads (shared through Redis when configured) and its list reads.
fn request_limits(
    settings: &Settings,
    redis: &Option<Arc<RedisLimits>>,
) -> (
    crate::limits::writes::TenantWrites,
    crate::limits::uploads::TenantUploads,
    crate::limits::reads::TenantReads,
) {
    use crate::limits::{uploads::TenantUploads, writes::TenantWrites};
    let limits = &settings.limits;
    let (rate, burst) = (limits.tenant_writes_per_second, limits.tenant_writes_burst);
    let (writes, uploads) = match redis {
        Some(redis) => (
            TenantWrites::shared(rate, burst, redis.clone()),
            TenantUploads::shared(redis.clone()),
        ),
        None => (TenantWrites::new(rate, burst), TenantUploads::new()),
    };
    let reads = crate::limits::reads::TenantReads::new(
        limits.tenant_list_reads,
        Duration::from_secs(settings.server.request_timeout_secs) / 2,
    );
    (writes, uploads, reads)
}

/// The lanes' high-water marks, counting the outbox's rows as waiting
/// when the lanes have an outbox (SQS).
fn lane_backpressure(settings: &Settings, db: &Db, outbox: bool) -> Arc<LaneBackpressure> {
    let backpressure = LaneBackpressure::new(settings.lanes.clone());
    Arc::new(match outbox {
        true => backpressure.with_pending(Arc::new(OutboxRows(db.clone()))),
        false => backpressure,
    })
}

/// The unsubscribe links' signer, when `server.public_url` gives them an
/// address.
async fn unsubscribe_links(
    settings: &Settings,
    db: &Db,
) -> anyhow::Result<Option<Arc<crate::unsubscribe::Links>>> {
    Ok(
        crate::unsubscribe::Links::load(db, settings.server.public_url.as_deref())
            .await
            .context("reading the unsubscribe links' signing secret")?
            .map(Arc::new),
    )
}

/// Puts back in line the messages a stopped process was sending.
async fn release_interrupted_sends(db: &Db) -> anyhow::Result<()> {
    let released = db
        .release_interrupted_sends()
        .await
        .context("releasing messages a stopped process was sending")?;
    if released > 0 {
        info!(
            messages = released,
            "Messages an earlier run was sending wait to be sent again."
        );
    }
    Ok(())
}

/// A consumer per lane on `delivery`, and each channel's gated provider
/// pool (reported every second); none when consumers are off.
fn start_consumers(
    settings: &Settings,
    delivery: Option<Delivery>,
    background: &mut Vec<JoinHandle<()>>,
    shutdown_rx: &watch::Receiver<bool>,
) -> (Vec<Arc<LaneConsumer>>, Vec<(Channel, GatedProvider)>) {
    let Some(delivery) = delivery else {
        return (Vec::new(), Vec::new());
    };
    let providers = delivery.providers.live();
    background.push(tokio::spawn(report_provider_shares(
        providers.clone(),
        shutdown_rx.clone(),
    )));
    let consumers = Lane::ALL
        .iter()
        .map(|lane| LaneConsumer::new(*lane, settings.lanes.get(*lane).clone(), delivery.clone()))
        .collect();
    (consumers, providers)
}

/// The store's setting that keeps the fleet size last counted in Redis, so
/// that an instance starting while Redis is down knows how many share the
/// providers' rates.
const FLEET_SIZE_SETTING: &str = "limits.fleet_size";

/// The Redis limits' client (with its heartbeat) when limits are kept in
/// Redis; `None` when they are kept in this process.
async fn limits_in_redis(
    settings: &Settings,
    db: &Db,
    background: &mut Vec<JoinHandle<()>>,
    shutdown_rx: &watch::Receiver<bool>,
) -> anyhow::Result<Option<Arc<RedisLimits>>> {
    Ok(match settings.limits.backend {
        LimitsBackend::Local => {
            metrics::gauge!(crate::metrics::LIMITS_BACKEND_UP).set(1.0);
            None
        }
        LimitsBackend::Redis => {
            let known = match db.setting(FLEET_SIZE_SETTING).await {
                Ok(value) => value.and_then(|v| v.parse::<u32>().ok()).unwrap_or(1),
                Err(err) => {
                    warn!(error = %err, "Could not read the fleet size last counted; assuming limits.expected_instances.");
                    1
                }
            };
            let redis = RedisLimits::connect(&settings.limits, known).await?;
            background.push(redis.spawn_heartbeat(shutdown_rx.clone()));
            background.push(tokio::spawn(remember_fleet_size(
                db.clone(),
                redis.clone(),
                known,
                shutdown_rx.clone(),
            )));
            Some(redis)
        }
    })
}

/// Keeps the fleet size the heartbeats count in the store (setting
/// [`FLEET_SIZE_SETTING`]) whenever it changes, checked every few seconds.
async fn remember_fleet_size(
    db: Db,
    redis: Arc<RedisLimits>,
    mut stored: u32,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        let live = redis.live_instances();
        if !redis.is_up() || live == stored {
            continue;
        }
        match db.set_setting(FLEET_SIZE_SETTING, &live.to_string()).await {
            Ok(()) => stored = live,
            Err(err) => warn!(error = %err, "Could not keep the fleet size in the store."),
        }
    }
}

/// The lanes on the configured backend, and how the accept writer stages
/// a message for them.
struct Lanes {
    queue: Arc<dyn LaneQueue>,
    tenant_queues: Arc<dyn TenantQueues>,
    staging: Staging,
    /// SQS: the outbox the accept path writes, and its relay's task.
    outbox: Option<Arc<Outbox>>,
    outbox_task: Option<JoinHandle<()>>,
}

/// Opens the lanes: the embedded queue in the store's SQLite file (each
/// tenant's hold and isolation set, dedicated backlogs signalled), the
/// lanes in the PostgreSQL store, or the SQS queues with their outbox and
/// its sweeps.
async fn open_lanes(
    settings: &Settings,
    db: &Db,
    registry: &Arc<Registry>,
    store_writer: &Writer,
    background: &mut Vec<JoinHandle<()>>,
    shutdown_rx: &watch::Receiver<bool>,
) -> anyhow::Result<Lanes> {
    Ok(match settings.queue.backend {
        QueueBackend::Embedded => open_embedded(settings, db, registry, store_writer).await?,
        QueueBackend::Postgres => {
            let lanes = PgLanes::open(db.lanes_engine()?, settings.lanes.clone())
                .await
                .context("opening the lanes in PostgreSQL")?;
            // Tenant deletion erases a tenant's waiting copies through it.
            registry.route_isolation_to(lanes.clone());
            // Every dedicated queue with backlog has an attention entry
            // waiting (one lost between a slice and its signal is made).
            lanes
                .reconcile_attention()
                .await
                .context("signalling dedicated tenant queues")?;
            Lanes {
                queue: lanes.clone(),
                tenant_queues: lanes,
                staging: Staging::Lanes,
                outbox: None,
                outbox_task: None,
            }
        }
        QueueBackend::Sqs => {
            let sqs = SqsQueue::connect(&settings.queue.sqs, settings.lanes.clone())
                .await
                .context("setting up the SQS lane queues")?
                .with_status_store(db.clone())
                .await?;
            let sqs = Arc::new(sqs);
            // Each tenant's isolation, now and after every reload (so a
            // change made on another instance routes here too).
            registry.route_isolation_to(sqs.clone());
            // Dedicated queues with backlog get a signal (one a
            // crash cut off between the work and its signal).
            match sqs.reconcile_attention().await {
                Ok(0) => {}
                Ok(signalled) => {
                    info!(signalled, "Dedicated tenant queues with backlog signalled.")
                }
                Err(err) => {
                    warn!(error = %format!("{err:#}"), "Could not look for dedicated tenant queues with backlog; their next send or the attention sweep signals them.")
                }
            }
            let tenant_queues: Arc<dyn TenantQueues> = sqs.clone();
            let queue: Arc<dyn LaneQueue> = sqs;
            let (outbox, tasks) = Outbox::start(db.clone(), queue.clone(), &settings.queue.sqs)
                .await
                .context("starting the SQS outbox")?;
            background.push(tokio::spawn(crate::scheduler::run_outbox_sweeps(
                outbox.clone(),
                Duration::from_secs(settings.queue.sqs.outbox_sweep_secs),
                shutdown_rx.clone(),
            )));
            Lanes {
                queue,
                tenant_queues,
                staging: Staging::Outbox,
                outbox: Some(outbox),
                outbox_task: Some(tasks.forgetter),
            }
        }
    })
}

/// `channel`'s providers with their gate: one line of waiting messages
/// over a bucket per provider.
///
/// The gate serves waiting messages high priority first with the lanes'
/// share rule; it is shared by both lanes, so it gives lower priorities the
/// larger of the two lanes' `low_priority_share`. With `redis`, each
/// provider's tokens come from its fleet-wide bucket (`{prefix}:gate:{name}`).
/// Names are kept for the process's life (metrics labels want them
/// `'static`); a process builds its pools once.
async fn gated(
    settings: &crate::config::ProvidersSettings,
    channel: Channel,
    low_priority_share: f64,
    redis: Option<Arc<RedisLimits>>,
    public_url: Option<&str>,
) -> anyhow::Result<GatedProvider> {
    let entries = settings.pool(channel);
    let specs: Vec<MemberSpec> = entries
        .iter()
        .map(|entry| MemberSpec {
            name: entry.name.to_owned(),
            weight: entry.settings.weight,
            rate_per_second: entry.settings.rate_per_second,
            burst: entry.settings.burst,
        })
        .collect();
    let gate = ProviderGate::pool(&specs, low_priority_share, &settings.health);
    let gate = match redis {
        Some(redis) => gate.with_global_bucket(redis, channel.as_str()),
        None => gate,
    };
    let mut members = Vec::with_capacity(entries.len());
    for (at, entry) in entries.iter().enumerate() {
        // The first SMS provider keeps the callback path of a pool of one;
        // each other one has its own, so its token verifies its callbacks.
        let callback = public_url.map(|url| {
            let url = url.trim_end_matches('/');
            if at == 0 {
                format!("{url}{}", crate::providers::sms_http::CALLBACK_PATH)
            } else {
                format!(
                    "{url}{}/{}",
                    crate::providers::sms_http::CALLBACK_PATH,
                    entry.name
                )
            }
        });
        let provider = crate::providers::build(entry.settings, channel, callback)
            .await
            .with_context(|| format!("setting up the {channel} provider {:?}", entry.name))?;
        let name: &'static str = Box::leak(entry.name.to_owned().into_boxed_str());
        crate::metrics::register_provider(name);
        members.push(PoolMember {
            name,
            provider,
            breaker: Arc::new(crate::limits::breaker::CircuitBreaker::new(
                crate::limits::breaker::BreakerSettings::of(entry.settings),
            )),
        });
    }
    Ok(GatedProvider {
        gate: Arc::new(gate),
        members: members.into(),
    })
}

/// Keeps `fairlane_provider_share` current, and runs each gate's watchdog
/// ([`ProviderGate::watch`]), once a second.
async fn report_provider_shares(
    pools: Vec<(Channel, GatedProvider)>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
        }
        for (channel, pool) in &pools {
            if pool.gate.watch() {
                metrics::counter!(crate::metrics::GATE_STALLS_TOTAL, "channel" => channel.as_str())
                    .increment(1);
                warn!(
                    channel = channel.as_str(),
                    waiting = ?pool.gate.waiting(),
                    stuck_for = ?pool.gate.stuck_for(),
                    "A provider gate's line was stuck: messages waited while no one took the tokens; its head was woken."
                );
            }
            for (member, view) in pool.members.iter().zip(pool.gate.view()) {
                let share = if view.paused_for.is_some() {
                    0.0
                } else {
                    view.share
                };
                metrics::gauge!(crate::metrics::PROVIDER_SHARE, "channel" => channel.as_str(), "provider" => member.name)
                    .set(share);
            }
        }
    }
}

/// Test keys' messages: at most this many simulated calls a second per
/// channel, in this process.
const TEST_RATE_PER_SECOND: f64 = 1000.0;
const TEST_BURST: u32 = 100;

/// The simulated provider of a channel, with its own gate (test sends use
/// no real provider's tokens); a call that never answers times out after
/// the real provider's `timeout_ms`.
fn simulated(settings: &crate::config::ProviderSettings, low_priority_share: f64) -> GatedProvider {
    let timeout = settings.timeout_ms.map_or(
        crate::providers::DEFAULT_TIMEOUT,
        std::time::Duration::from_millis,
    );
    GatedProvider::single(
        crate::providers::simulated::NAME,
        Arc::new(crate::providers::simulated::SimulatedProvider::new(timeout)),
        ProviderGate::with_share(TEST_RATE_PER_SECOND, TEST_BURST, low_priority_share),
        crate::limits::breaker::CircuitBreaker::new(crate::limits::breaker::BreakerSettings::of(
            settings,
        )),
    )
}

/// Each channel's gated pool in each world: the configured providers for
/// live messages, the simulated one for test keys' (timing out after the
/// channel's first provider's `timeout_ms`).
async fn channel_providers(
    settings: &Settings,
    share: f64,
    redis: &Option<Arc<RedisLimits>>,
) -> anyhow::Result<ChannelProviders> {
    let mut pools = Vec::new();
    for channel in Channel::ALL.iter().copied() {
        // Only a kind that is called back (`http`) uses the public URL.
        let public_url = settings.server.public_url.as_deref();
        let live = gated(
            &settings.providers,
            channel,
            share,
            redis.clone(),
            public_url,
        )
        .await?;
        let first = settings.providers.pool(channel)[0].settings;
        pools.push((channel, World::Live, live));
        pools.push((channel, World::Test, simulated(first, share)));
    }
    ChannelProviders::new(pools)
}

/// Completes on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => info!("SIGINT received; shutting down."),
        _ = terminate => info!("SIGTERM received; shutting down."),
    }
}

/// `fairlane serve`: builds and runs until SIGINT/SIGTERM.
pub async fn serve(settings: Settings) -> anyhow::Result<()> {
    let app = Application::build(settings).await?;
    info!(address = %app.local_addr(), "fairlane is listening.");
    app.run_until(shutdown_signal()).await
}

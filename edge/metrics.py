"""Prometheus metrics (``GET /metrics``), one registry per edge.

Names follow what users already graph: vLLM's request/latency histograms
(``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
``e2e_request_latency_seconds``) and OpenTelemetry's gen_ai server metrics,
under the ``iop_`` prefix. Nothing here is touched per chunk: runs are
observed once, when they close.

A ``model`` label is a name from the config's ``[[models]]`` or one some
linked node has advertised, at most :data:`MAX_MODEL_LABELS` of those at
once; any other name is counted under ``"other"`` (:data:`OTHER_MODEL`), so
neither names a client invents nor a node that links again and again with
new ones can grow the series. Once that many are labelled, a model a linked
node serves takes the label of one no linked node serves any more (whose
series are removed): the first 256 names seen held the labels for the
edge's life, and a node that had advertised 256 made-up ones, or a year of
model versions, left every model linked later counted as ``other`` (an
outside audit).
An ``api`` label is the front door the request came through (its route's
``api``: chat, completions, embeddings, messages, responses), never a
client's string; a run carries its request's (``Run.api``).
"""

from __future__ import annotations

from typing import Any

import structlog
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics import MetricWrapperBase

from edge.runs import Run, RunService
from edge.runs.service import PLACEMENTS

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
PREFIX_BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)

log = structlog.get_logger("iop.edge.metrics")

CONTENT_TYPE = CONTENT_TYPE_LATEST
OTHER_MODEL = "other"  # the model label of every name neither configured nor advertised
# Advertised names (not in ``[[models]]``) given a label of their own, first come: some
# hundreds of series each, and a node may name 1,024 models a link, and link again.
MAX_MODEL_LABELS = 256
MAX_ENGINE_SERIES = 2048  # node and model pairs of the iop_engine_* gauges (512 nodes of 4 models)


class EdgeMetrics:
    def __init__(self, runs: RunService, edge: Any = None) -> None:
        self._runs = runs
        self._configured = frozenset(m.name for m in runs.config.models)
        # Advertised names with a label of their own (MAX_MODEL_LABELS), oldest first
        self._labelled: dict[str, None] = {}
        self._served: tuple[int, frozenset[str]] = (-1, frozenset())  # (models_version, the models served)
        self._no_room_at = -1  # the models_version at which every label was of a model served
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "iop_requests",
            "HTTP requests to the API routes by API, model and outcome (rejected_<status> before any run)",
            ["api", "model", "outcome"],
            registry=r,
        )
        self.usage_estimated = Counter(
            "iop_usage_estimated",
            "Responses whose usage holds counts the edge estimated (the upstream reported none)",
            ["api", "model"],
            registry=r,
        )
        self.runs_in_flight = Gauge("iop_runs_in_flight", "Runs dispatched to nodes and not yet closed", registry=r)
        self.runs_in_flight.set_function(lambda: runs.on_nodes)
        self.queue_depth = Gauge("iop_queue_depth", "Requests waiting for a node slot", registry=r)
        self.queue_depth.set_function(lambda: runs.queue_depth())
        self.nodes_linked = Gauge("iop_nodes_linked", "Nodes with a live link", registry=r)
        self.nodes_linked.set_function(lambda: len(runs.links))
        self.buffered_bytes = Gauge(
            "iop_buffered_bytes",
            "Bytes of runs' events waiting for their clients (bounded by max_buffered_bytes)",
            registry=r,
        )
        self.buffered_bytes.set_function(lambda: runs.buffered.bytes)
        self.queue_time = Histogram(
            "iop_queue_time_seconds",
            "Time spent waiting for a node slot, however the wait ended (a slot, a timeout, the client leaving)",
            ["api", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "iop_time_to_first_token_seconds",
            "Time from dispatch to the run's first event",
            ["api", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "iop_inter_token_latency_seconds",
            "Inter-token latency: each run's mean gap between events, observed once per run",
            ["api", "model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.run_duration = Histogram(
            "iop_e2e_request_latency_seconds",
            "Run duration, dispatch to close",
            ["api", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.run_ends = Counter("iop_runs_ended", "Runs by how they ended", ["api", "model", "cause"], registry=r)
        self.cancels = Counter(
            "iop_run_cancels",
            "Runs cancelled on the node, by cause (client_gone, timeout, node_lost, ...)",
            ["api", "cause"],
            registry=r,
        )
        self.tool_retries = Counter(
            "iop_tool_validation_retries",
            "Runs retried because their tool calls failed validation",
            ["api", "model"],
            registry=r,
        )
        self.node_stalls = Counter(
            "iop_node_stalls",
            "Times a node was routed around because its runs were not starting (its unstarted runs moved)",
            registry=r,
        )
        self.nodes_stalled = Gauge(
            "iop_nodes_stalled", "Linked nodes being routed around for some model right now", registry=r
        )
        self.nodes_stalled.set_function(
            lambda: sum(lk.stalled(trio.current_time()) for lk in list(runs.links.values()))
        )
        runs.on_stall.append(lambda _link: self.node_stalls.inc())
        self.tokens = Counter(
            "iop_tokens",
            "Tokens by model and kind (prompt, completion), as the access lines and the ledger count them "
            "(the model server's usage, else the edge's estimate); vLLM's prompt_tokens and generation_tokens",
            ["api", "model", "kind"],
            registry=r,
        )
        self.runs_moved = Counter(
            "iop_runs_moved",
            "Runs moved to another node before their first event (failover), by why: node_lost, "
            "node_stalled (its runs were not starting), node_failed (its model server failed it at once), "
            "node_refused (refused at once with a 4xx: moved to a node with a free slot, once); and "
            "rerun_node_lost, rerun_node_stalled: a collected run (its client shown nothing yet: "
            "non-streamed, or a tool call's) run again on another node after its node was lost or stalled mid-run",
            ["model", "why"],
            registry=r,
        )
        runs.on_move.append(lambda model, why: self.runs_moved.labels(model, why).inc())
        self.placements = Counter(
            "iop_placements",
            "Nodes chosen for requests, by how: session (affinity), prefix (the longest prompt prefix sent "
            "there), rendezvous (no local match: the same choice on every edge), least_loaded, random",
            ["how"],
            registry=r,
        )
        for how in PLACEMENTS:
            self.placements.labels(how)
        self.prefix_blocks = Histogram(
            "iop_prefix_matched_blocks",
            "Prompt prefix blocks (256 bytes of text each) matched on the chosen node, per prefix placement",
            buckets=PREFIX_BLOCK_BUCKETS,
            registry=r,
        )
        self.prefix_waits = Counter(
            "iop_prefix_waits",
            "Requests that waited for the busy node holding their prompt prefix (prefix_wait_ms), by how the "
            "wait ended: there (a slot freed on that node), elsewhere (the wait ran out: another node)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("there", "elsewhere"):
            self.prefix_waits.labels(outcome)
        runs.on_prefix_wait.append(lambda there: self.prefix_waits.labels("there" if there else "elsewhere").inc())
        self.prefix_index_entries = Gauge(
            "iop_prefix_index_entries",
            "Prompt prefix blocks the edge remembers (prefix_index_entries caps it)",
            registry=r,
        )
        self.prefix_index_entries.set_function(lambda: len(runs.prefixes))
        # Read on the event loop at a scrape: what walks the edge's own state (the rest, the counters
        # and histograms, are read in a worker thread: prometheus_client locks their values).
        gauges = [
            self.runs_in_flight,
            self.queue_depth,
            self.nodes_linked,
            self.buffered_bytes,
            self.nodes_stalled,
            self.prefix_index_entries,
        ]
        collectors = [_ModelCollector(self, runs), _EngineCollector(self, runs), _LinkCollector(runs)]
        if edge is not None:
            self.large_requests = Gauge(
                "iop_large_requests_in_flight",
                "Requests of 1 MiB or more in flight (max_large_requests caps it: past it, a 503)",
                registry=r,
            )
            self.large_requests.set_function(lambda: edge.large_requests.held)
            gauges.append(self.large_requests)
            collectors += [_KeyCollector(edge), _StateCollector(edge)]
        for collector in collectors:
            r.register(collector)
        self._on_loop = _Collectors(gauges + collectors)
        read_on_loop = {id(gauge) for gauge in gauges}
        self._in_thread = _Collectors(
            [m for m in vars(self).values() if isinstance(m, MetricWrapperBase) and id(m) not in read_on_loop]
        )
        self._scrapes = trio.CapacityLimiter(1)  # (concurrent scrapes take turns: one thread at a time)
        self._by_model = [
            metric
            for metric in vars(self).values()
            if isinstance(metric, MetricWrapperBase) and "model" in metric._labelnames  # noqa: SLF001
        ]
        runs.on_placed.append(self.observe_placement)
        runs.on_run_closed.append(self.observe_run)
        runs.on_queue_wait.append(self.observe_queue_wait)

    def observe_queue_wait(self, model: str, api: str, seconds: float) -> None:
        self.queue_time.labels(api, self.model_label(model)).observe(seconds)

    def model_label(self, model: object) -> str:
        """The ``model`` label for a requested name: the name itself if it is
        configured, or a node has advertised it and it is one of the first
        :data:`MAX_MODEL_LABELS` such names; else :data:`OTHER_MODEL`."""
        if not isinstance(model, str):
            return OTHER_MODEL
        labelled = self._labelled
        if model in labelled or model in self._configured:
            return model
        if not self._runs.is_known(model):
            return OTHER_MODEL
        if len(labelled) >= MAX_MODEL_LABELS and not self._make_room(model):
            return OTHER_MODEL
        labelled[model] = None
        if len(labelled) == MAX_MODEL_LABELS:
            log.warning(
                "metrics: model names nodes advertised now have their most labels; the next are counted as other",
                labels=MAX_MODEL_LABELS,
            )
        return model

    def _make_room(self, model: str) -> bool:
        """The labels are all taken: if a linked node serves ``model``, the oldest label of a
        name no linked node serves is given up (its series removed) and True."""
        runs = self._runs
        if self._no_room_at == runs.models_version:  # (a request of an unlabelled model: no scan each)
            return False
        version, served = self._served
        if version != runs.models_version:
            served = frozenset(name for link in list(runs.links.values()) for name in link.models)
            self._served = (runs.models_version, served)
        if model not in served:
            return False
        for old in self._labelled:
            if old not in served:
                del self._labelled[old]
                for metric in self._by_model:
                    metric.remove_by_labels({"model": old})
                return True
        self._no_room_at = runs.models_version
        return False

    def observe_placement(self, how: str, blocks: int) -> None:
        self.placements.labels(how).inc()
        if blocks:
            self.prefix_blocks.observe(blocks)

    def observe_run(self, run: Run) -> None:
        now = trio.current_time()
        model = self.model_label(run.slot.model)
        cause = run.cause or "unknown"
        api = run.api or "unknown"
        self.run_ends.labels(api, model, cause).inc()
        self.run_duration.labels(api, model).observe(now - run.started_at)
        if run.first_event_at is not None:
            self.ttft.labels(api, model).observe(run.first_event_at - run.started_at)
            if run.deltas_seen > 1:
                self.tpot.labels(api, model).observe((run.last_event_at - run.first_event_at) / (run.deltas_seen - 1))
        if cause not in ("complete", "run_error"):
            self.cancels.labels(api, cause).inc()

    def render(self) -> bytes:
        """The whole registry's text, here and now (for tests and tools; the route's is :meth:`scrape`)."""
        return generate_latest(self.registry)

    async def scrape(self) -> bytes:
        """What ``GET /metrics`` answers: :meth:`render`'s series, the counters and histograms
        written out in a worker thread. With many models labelled (256 of them, each through
        three APIs: 59,000 lines, 4.9 MB) a scrape held the event loop 0.5 s, every stream and
        link with it, as often as anyone asked (an open edge's /metrics is anyone's; an outside
        audit); in the thread, the loop has the GIL back every few ms meanwhile."""
        live = generate_latest(self._on_loop)  # (cheap: a few series per model, node and key)
        rest = await trio.to_thread.run_sync(generate_latest, self._in_thread, limiter=self._scrapes)
        return rest + live


class _Collectors:
    """Some of a registry's collectors, as one collector (what generate_latest reads)."""

    def __init__(self, collectors: list) -> None:
        self._collectors = collectors

    def collect(self):
        for collector in self._collectors:
            yield from collector.collect()


class _ModelCollector:
    """``iop_model_queue_depth{model}`` and ``iop_model_runs_in_flight{model}``: the queue and
    the runs of each model a linked node serves (vLLM's ``num_requests_waiting`` and
    ``num_requests_running`` are per model too), read at scrape time; the unlabelled totals stay."""

    def __init__(self, metrics: EdgeMetrics, runs: RunService) -> None:
        self._metrics = metrics
        self._runs = runs

    def collect(self):
        label = self._metrics.model_label
        runs = self._runs
        waiting = GaugeMetricFamily(
            "iop_model_queue_depth", "Requests waiting for a node slot, per model", labels=("model",)
        )
        running = GaugeMetricFamily(
            "iop_model_runs_in_flight", "Runs dispatched to nodes and not yet closed, per model", labels=("model",)
        )
        served = {label(model) for link in list(runs.links.values()) for model in link.models}
        queued, flying = dict.fromkeys(served, 0), dict.fromkeys(served, 0)
        for model, depth in runs.queue_depths().items():
            model = label(model)
            queued[model] = queued.get(model, 0) + depth
        for run in list(runs.runs.values()):
            if run.requeued is None:  # (a run moved off its node, waiting for a slot, is queued)
                model = label(run.slot.model)
                flying[model] = flying.get(model, 0) + 1
        for family, counts in ((waiting, queued), (running, flying)):
            for model in sorted(counts):
                family.add_metric((model,), counts[model])
        yield from (waiting, running)


class _EngineCollector:
    """``iop_engine_*{node, model}``: each linked node's model servers' own
    load, as last reported (read at scrape time, so an unlinked node's series
    are gone with it): of models with a ``model`` label of their own, and at most
    :data:`MAX_ENGINE_SERIES` node and model pairs. (Every name of every link went in:
    15 links of one token with 1,024 models each made a scrape of 61,440 such series,
    18.9 MB, read on the event loop, ``/healthz`` at most 1 s meanwhile: an outside
    audit.)"""

    def __init__(self, metrics: EdgeMetrics, runs: RunService) -> None:
        self._metrics = metrics
        self._runs = runs

    def collect(self):
        gauges = (
            (
                "waiting",
                GaugeMetricFamily(
                    "iop_engine_requests_waiting", "Requests queued in the model server", labels=("node", "model")
                ),
            ),
            (
                "running",
                GaugeMetricFamily(
                    "iop_engine_requests_running",
                    "Requests the model server is generating for",
                    labels=("node", "model"),
                ),
            ),
            (
                "kv_cache_usage",
                GaugeMetricFamily(
                    "iop_engine_kv_cache_usage",
                    "Fraction of the model server's KV cache in use",
                    labels=("node", "model"),
                ),
            ),
            (
                "prefix_cache_hit_rate",
                GaugeMetricFamily(
                    "iop_engine_prefix_cache_hit_rate",
                    "Share of prompt tokens the model server found in its prefix cache since it started",
                    labels=("node", "model"),
                ),
            ),
        )
        label, room = self._metrics.model_label, MAX_ENGINE_SERIES
        for link in list(self._runs.links.values()):
            for model, load in list(link.engine.items()):
                if room <= 0:
                    break
                if label(model) == OTHER_MODEL:
                    continue
                room -= 1
                for field, gauge in gauges:
                    value = getattr(load, field)
                    if value is not None:
                        gauge.add_metric((link.node_id, model), value)
        for _, gauge in gauges:
            yield gauge


class _KeyCollector:
    """``iop_key_*{key}``: requests, tokens and refusals per client key (the
    key's id; bounded by the keys the edge has: configured and run-time)."""

    def __init__(self, edge: Any) -> None:
        self._edge = edge

    def collect(self):
        requests = CounterMetricFamily("iop_key_requests", "API requests per client key", labels=("key",))
        tokens = CounterMetricFamily(
            "iop_key_tokens", "Tokens per client key (usage, or the edge's estimate)", labels=("key", "kind")
        )
        limited = CounterMetricFamily(
            "iop_key_rate_limited",
            "Requests refused with 429 per client key, by limit: rpm, tpm, concurrency, budget",
            labels=("key", "limit"),
        )
        in_flight = GaugeMetricFamily("iop_key_in_flight", "Requests in flight per client key", labels=("key",))
        for key in list(self._edge.keys.by_id.values()):
            requests.add_metric((key.id,), key.requests)
            tokens.add_metric((key.id, "prompt"), key.prompt_tokens)
            tokens.add_metric((key.id, "completion"), key.completion_tokens)
            for limit, n in key.limited.items():
                limited.add_metric((key.id, limit), n)
            in_flight.add_metric((key.id,), key.in_flight)
        yield from (requests, tokens, limited, in_flight)


class _LinkCollector:
    """The edge's time node links take, measured and held to a share (:mod:`edge.frame_limit`),
    and each linked node's waits (read at scrape time: an unlinked node's series is gone with it)."""

    def __init__(self, runs: RunService) -> None:
        self._runs = runs

    def collect(self):
        from edge.frame_limit import links_time  # (edge.frame_limit imports edge.connection, which imports this)

        held, waited = links_time()
        read = CounterMetricFamily(
            "iop_link_read_seconds",
            "Time the edge spent on node links' frames, less handing their events to runs and clients",
        )
        read.add_metric((), held)
        throttled = CounterMetricFamily(
            "iop_link_throttled_seconds", "Time node links' reads waited past their share of the edge's time"
        )
        throttled.add_metric((), waited)
        per_node = CounterMetricFamily(
            "iop_node_link_throttled_seconds",
            "Time a linked node's frames waited unread past its share of the edge's time",
            labels=("node",),
        )
        for link in list(self._runs.links.values()):
            if link.hold is not None:
                per_node.add_metric((link.node_id,), link.hold.waited)
        yield from (read, throttled, per_node)


class _StateCollector:
    """The ledger's and the shared state's health."""

    def __init__(self, edge: Any) -> None:
        self._edge = edge

    def collect(self):
        ledger, shared = self._edge.ledger, self._edge.shared
        if ledger is not None:
            up = GaugeMetricFamily("iop_ledger_up", "1 while the ledger's database answers")
            up.add_metric((), 1 if ledger.available else 0)
            pending = GaugeMetricFamily("iop_ledger_pending", "Usage records waiting to be written")
            pending.add_metric((), ledger.pending)
            failures = CounterMetricFamily("iop_ledger_write_failures", "Failed ledger database calls")
            failures.add_metric((), ledger.failures)
            dropped = CounterMetricFamily("iop_ledger_dropped", "Usage records dropped from a full buffer")
            dropped.add_metric((), ledger.dropped)
            yield from (up, pending, failures, dropped)
        if shared is not None:
            state = GaugeMetricFamily(
                "iop_shared_state_up", "1 while key limits are leased from the shared state (Redis), 0: local limits"
            )
            state.add_metric((), 1 if shared.up else 0)
            borrows = CounterMetricFamily(
                "iop_shared_state_borrows",
                "Requests that waited on a round trip to the shared state (Redis): what this edge held of a "
                "key's limits did not cover them",
            )
            borrows.add_metric((), shared.borrows)
            yield state
            yield borrows

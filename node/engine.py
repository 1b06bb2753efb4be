"""A model server's own load, from its Prometheus metrics.

A model with ``metrics_url`` is sampled every ``metrics_interval_s``: the
node GETs the text exposition, reads the few gauges below and reports them to
every linked edge in a ``load`` frame (only when they changed, and to a new
link at once). Edges use them beside their own in-flight counts to place runs
(``edge.runs.link.NodeLink.load``), show them in ``/v1/nodes`` and export
them as ``iop_engine_*`` gauges.

Known names (a series per model, engine or rank: waiting and running are
summed, the KV-cache fraction is the highest):

- waiting: ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``,
  ``llamacpp:requests_deferred``;
- running: ``vllm:num_requests_running``, ``sglang:num_running_reqs``,
  ``llamacpp:requests_processing``;
- KV cache in use (0..1): ``vllm:kv_cache_usage_perc`` (older vLLM:
  ``vllm:gpu_cache_usage_perc``), ``sglang:token_usage``,
  ``llamacpp:kv_cache_usage_ratio``;
- prefix cache hit rate (0..1, prompt tokens found cached since it started):
  ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``
  (older vLLM: ``vllm:gpu_prefix_cache_hit_rate``), ``sglang:cache_hit_rate``.
  (The ``sim`` adapter reports its own, :meth:`node.agent.NodeAgent`.)

A server that cannot be reached, answers with an error or with none of these
names has no engine load (reported as unknown, so edges fall back to their
in-flight counts); one warning is logged when sampling starts failing and one
info line when it works again.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import urlsplit

import structlog
import trio

from node import http1
from node.config import ModelConfig
from proto import EngineLoad

log = structlog.get_logger("iop.node.engine")

MAX_METRICS_BYTES = 4 * 1024 * 1024
# A sample line longer is passed over (no server writes one; its label block is matched by a
# regular expression, which holds the GIL: a 4 MB line held the node's event loop 0.4 s).
MAX_LINE_CHARS = 16 * 1024

WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing")
KV_CACHE = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",
)


HIT_RATE = ("vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def _ratio(value: float) -> float:
    return min(max(value, 0.0), 1.0)


_NAMES = frozenset((*WAITING, *RUNNING, *KV_CACHE, *HIT_RATE, HITS, QUERIES))
_PREFIXES = tuple(_NAMES)


def parse(text: str, served: str = "") -> EngineLoad:
    """The engine load in a Prometheus text exposition (fields it lacks are None): of the
    samples whose ``model_name`` label is ``served`` (the model's name at its server), when
    there are any; else of all. (A page serving two models was summed whole: the node showed
    the load of both as its model's, 12 times it, and placement took it so; an outside audit.)

    Only the lines of the names above are read, each by its label block's end: linear in the page,
    whatever its labels. (prometheus_client's parser, used before, read every sample and its labels
    on the node's event loop: a page of one sample with 100,000 labels, 1.1 MB, kept the node busy
    until its links timed out, and its cost grew with the square of the labels: 148 s of CPU for
    300,000.) Lines end at ``\n`` only (a label value may hold any other line separator, such as
    U+2028, which ``str.splitlines`` split on: a label's text became a sample). A line of a known
    name that cannot be read, or longer than :data:`MAX_LINE_CHARS`, is passed over."""
    samples = []
    for line in text.split("\n"):
        line = line.strip(" \t\r")
        if not line.startswith(_PREFIXES) or len(line) > MAX_LINE_CHARS:
            continue
        sample = _sample(line)
        if sample is not None:
            samples.append(sample)
    if served:
        escaped = served.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")  # (as the page writes it)
        # (the label itself, not one whose name ends so, such as served_model_name: a re-check)
        label = re.compile(r'[{,]\s*model_name\s*=\s*"' + re.escape(escaped) + '"')
        mine = [sample for sample in samples if label.search(sample[2])]
        if mine:
            samples = mine
    return _load(samples)


def _load(samples: list[tuple[str, float, str]]) -> EngineLoad:
    """The engine load of ``samples`` (name, value, label block)."""
    waiting: float | None = None
    running: float | None = None
    kv: float | None = None
    rate: float | None = None
    hits = queries = 0.0
    for name, value, _ in samples:
        if name in WAITING:
            waiting = (waiting or 0.0) + value
        elif name in RUNNING:
            running = (running or 0.0) + value
        elif name in KV_CACHE:
            kv = max(kv or 0.0, _ratio(value))
        elif name == HITS:
            hits += value
        elif name == QUERIES:
            queries += value
        else:
            rate = _ratio(value)
    if queries > 0 and hits / queries == hits / queries:  # (not NaN: infinite counts)
        rate = _ratio(hits / queries)
    return EngineLoad(waiting=waiting, running=running, kv_cache_usage=kv, prefix_cache_hit_rate=rate)


# A label block: quoted values may hold `}` and escaped quotes (alternatives that never overlap,
# so matching is linear in the block).
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABELS = re.compile(r'\{(?:[^"}]|"(?:[^"\\]|\\.)*")*\}')


def _sample(line: str) -> tuple[str, float, str] | None:
    """A sample line's name (one of :data:`_NAMES`), value and label block ("" if none); None
    if it is not one, or its value is not a number (NaN is not one either). An OpenMetrics
    exemplar after the value (`` # {trace_id="..."} 1.0``) is not the value."""
    end = _NAME.match(line).end()  # (the line starts with a known name)
    name = line[:end]
    if name not in _NAMES:  # (a longer name that starts with a known one)
        return None
    rest = line[end:].lstrip(" \t")
    block = ""
    if rest[:1] == "{":
        labels = _LABELS.match(rest)
        if labels is None:
            return None
        block = labels.group()
        rest = rest[labels.end() :]
    parts = rest.partition("#")[0].split()
    if not 1 <= len(parts) <= 2:  # the value, perhaps a timestamp
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    if value != value or "_" in parts[0]:  # NaN; float() also reads 1_000, which Prometheus does not write
        return None
    return name, value, block


class EngineSampler:
    """Samples one model's metrics URL for ever; ``report(model, load)`` gets
    every change (an empty :class:`EngineLoad` when it is no longer known)."""

    def __init__(self, model: ModelConfig, report: Callable[[str, EngineLoad], None], ca_file: str = "") -> None:
        self.model = model.name
        self.served = model.target or model.name
        self.interval = model.metrics_interval_s
        parts = urlsplit(model.metrics_url)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.client = http1.Client(
            f"{parts.scheme}://{parts.netloc}",
            connect_timeout=max(self.interval, 1.0),
            read_timeout=max(self.interval, 1.0),
            ca_file=ca_file,
        )
        self.report = report
        self.current = EngineLoad()
        self.failing = False

    async def sample(self) -> EngineLoad:
        async with self.client.request("GET", self.path, headers={"accept": "text/plain"}) as response:
            body = bytearray()  # (bytes joined at each read copied the page again each time)
            while data := await response.read():
                body += data
                if len(body) > MAX_METRICS_BYTES:
                    raise ValueError(f"metrics larger than {MAX_METRICS_BYTES} bytes")
            if response.status != 200:
                raise ValueError(f"status {response.status}")
        # In a worker thread (a page of 100,000 samples of a known name takes 70 ms to read; one of
        # empty lines, 23 ms a 256 KB), so the node's links and runs get their turns meanwhile.
        load = await trio.to_thread.run_sync(parse, body.decode("utf-8", "replace"), self.served)
        if load == EngineLoad():
            raise ValueError("no known engine metric")
        return load

    async def run(self) -> None:
        try:
            while True:
                try:
                    with trio.fail_after(max(self.interval, 1.0) * 2):
                        load = await self.sample()
                except (http1.HTTPError, ValueError, trio.TooSlowError) as e:
                    if not self.failing:
                        self.failing = True
                        log.warning("engine metrics unavailable", model=self.model, error=f"{type(e).__name__}: {e}")
                    load = EngineLoad()
                else:
                    if self.failing:
                        self.failing = False
                        log.info("engine metrics available again", model=self.model)
                if load != self.current:
                    self.current = load
                    self.report(self.model, load)
                await trio.sleep(self.interval)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await self.client.aclose()

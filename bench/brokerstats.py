"""The embedded broker's own request counts, read over JMX (``ROPEWALK_BROKER_JMX_PORT``, which ``BenchEnv`` sets):
how many requests of each kind it served, and how many partition appends and reads each topic took. Two readings
around a phase, divided by its jobs, are the broker requests per job that ``ropewalk bench`` reports.

Read with Kafka's own ``JmxTool`` (kafka-tools, in the broker's libs), one JVM per reading: a few seconds of wall
time and about a second of one core, outside the processes the bench measures (it runs between phases).

* ``requests``: ``kafka.network:type=RequestMetrics,name=RequestsPerSec,request=<API>`` counts, summed over the
  API's versions (``FetchConsumer`` / ``FetchFollower``, which count the same fetches again by who sent them, left
  out);
* ``produce_appends`` / ``fetch_reads`` per topic: ``BrokerTopicMetrics`` ``TotalProduceRequestsPerSec`` and
  ``TotalFetchRequestsPerSec``, which the broker counts per partition a request names (a produce request holding
  batches of three partitions of a topic counts 3 there), so they say which topics the requests are about, not how
  many requests there were.
"""
from __future__ import annotations

import re
import subprocess
from collections import Counter
from typing import Any

from infra.broker import LIBS, java_binary, jmx_port_of
from infra.config import Config

TIMEOUT_S = 60.0
OBJECTS = ("kafka.network:type=RequestMetrics,name=RequestsPerSec,request=*,version=*",
           "kafka.server:type=BrokerTopicMetrics,name=TotalProduceRequestsPerSec,topic=*",
           "kafka.server:type=BrokerTopicMetrics,name=TotalFetchRequestsPerSec,topic=*")
SAME_AGAIN = frozenset({"FetchConsumer", "FetchFollower"})  # fetches counted a second time, by who sent them
_LINE = re.compile(r"^(?P<name>[^:]+:[^:]*?):Count=(?P<count>\d+)$")


def parse(text: str, prefix: str = "") -> dict[str, Any]:
    """JmxTool's ``properties`` output as ``{"requests": {api: n}, "produce_appends": {topic: n}, "fetch_reads":
    {topic: n}}``; topics of ``prefix`` only, named without it. Pure."""
    requests: Counter[str] = Counter()
    appends: Counter[str] = Counter()
    reads: Counter[str] = Counter()
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m is None:
            continue
        props = dict(kv.split("=", 1) for kv in m.group("name").split(":", 1)[1].split(",") if "=" in kv)
        n = int(m.group("count"))
        if props.get("type") == "RequestMetrics" and props.get("request") not in SAME_AGAIN:
            requests[props["request"]] += n
        elif props.get("type") == "BrokerTopicMetrics" and "topic" in props:
            topic = props["topic"]
            if not topic.startswith(prefix):
                continue
            topic = topic[len(prefix):]
            (appends if props.get("name") == "TotalProduceRequestsPerSec" else reads)[topic] += n
    return {"requests": dict(requests), "produce_appends": dict(appends), "fetch_reads": dict(reads)}


def read(cfg: Config) -> dict[str, Any] | None:
    """The broker's counts now (``parse``), summed over the nodes of an embedded cluster; None without a JMX port."""
    if cfg.broker_jmx_port is None or not cfg.embedded_broker:
        return None
    total: dict[str, Counter[str]] = {"requests": Counter(), "produce_appends": Counter(), "fetch_reads": Counter()}
    for node in cfg.broker_nodes:
        argv = [java_binary(), "-Xmx64m", "-cp", f"{LIBS}/*", "org.apache.kafka.tools.JmxTool",
                "--jmx-url", f"service:jmx:rmi:///jndi/rmi://127.0.0.1:{jmx_port_of(cfg, node.id)}/jmxrmi",
                "--attributes", "Count", "--one-time", "true", "--report-format", "properties"]
        for name in OBJECTS:
            argv += ["--object-name", name]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"JmxTool on node {node.id}: {done.stderr.strip().splitlines()[-1:]}")
        for k, v in parse(done.stdout, cfg.topic_prefix).items():
            total[k].update(v)
    return {k: dict(v) for k, v in total.items()}


def per_job(before: dict[str, Any] | None, after: dict[str, Any] | None, jobs: int) -> dict[str, Any] | None:
    """What the broker served between two readings, per job: requests by API (and in all), produce appends and fetch
    reads by topic. Pure."""
    if before is None or after is None or jobs <= 0:
        return None
    out: dict[str, Any] = {}
    for kind in ("requests", "produce_appends", "fetch_reads"):
        diff = {k: after[kind].get(k, 0) - before[kind].get(k, 0) for k in after[kind]}
        out[kind] = {k: round(v / jobs, 3) for k, v in sorted(diff.items()) if v > 0}
    out["requests_total"] = round(sum(out["requests"].values()), 3)
    return out

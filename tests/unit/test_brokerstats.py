"""bench/brokerstats.py: JmxTool's output read into request counts per API and appends/reads per topic (pure)."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from bench.brokerstats import parse, per_job  # noqa: E402

OUTPUT = """time=1795837022242
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=9:Count=10
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=11:Count=5
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Fetch,version=16:Count=40
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=FetchConsumer,version=16:Count=40
kafka.server:type=BrokerTopicMetrics,name=TotalProduceRequestsPerSec,topic=p.tasks:Count=7
kafka.server:type=BrokerTopicMetrics,name=TotalProduceRequestsPerSec,topic=other.tasks:Count=99
kafka.server:type=BrokerTopicMetrics,name=TotalFetchRequestsPerSec,topic=p.allocations:Count=80
Trying to connect to JMX url: service:jmx:rmi:///jndi/rmi://127.0.0.1:1/jmxrmi
"""


def test_parse_sums_versions_drops_repeats_and_other_prefixes():
    got = parse(OUTPUT, "p.")
    assert got == {"requests": {"Produce": 15, "Fetch": 40}, "produce_appends": {"tasks": 7},
                   "fetch_reads": {"allocations": 80}}


@pytest.mark.parametrize("before, after, jobs, want", [
    (None, {}, 1, None),
    ({}, None, 1, None),
    ({"requests": {"Produce": 15}, "produce_appends": {}, "fetch_reads": {}},
     {"requests": {"Produce": 35, "Fetch": 10}, "produce_appends": {"tasks": 4}, "fetch_reads": {}}, 10,
     {"requests": {"Fetch": 1.0, "Produce": 2.0}, "produce_appends": {"tasks": 0.4}, "fetch_reads": {},
      "requests_total": 3.0}),
])
def test_per_job(before, after, jobs, want):
    assert per_job(before, after, jobs) == want

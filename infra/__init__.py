"""Start, stop and status of the infrastructure Ropewalk runs on: the embedded broker (Apache Kafka, KRaft,
one node, from Maven Central; infra/broker.py) and a private redis-server, both with their data on disk under
the run directory; plus the configuration that points Ropewalk at them, or at a real Kafka cluster and Redis
instead."""

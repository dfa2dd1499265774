"""The Resource Broker: machine registry, the regional free pool, unavailability events.

Region specs in ``region`` (read or generate a region, expand it into machines); pure decisions in ``decide``.
"""

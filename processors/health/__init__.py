"""The Health Check Service: agent heartbeats → machine health (pure decisions in ``decide``)."""

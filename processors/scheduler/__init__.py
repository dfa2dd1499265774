"""The scheduler: job and task lifecycle, sharded by entitlement (pure transitions in ``lifecycle``)."""

"""The allocator: machines to entitlements and tasks to machines (pure placement in ``placement``)."""

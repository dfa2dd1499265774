"""The CLI's commands, one module per resource, each its parser (``add_commands``) beside its handlers: ``region``
(up, down, status), ``log`` (produce, watch, replay, rebuild, archive, restore, schemas, topics), ``entitlements``,
``jobs``, ``machines``, ``maintenance``, ``rebalance``, ``users`` (the API's users), ``history`` (at, shadow, explain,
history), ``keys``, ``intents`` (the Job Control Plane), ``srm`` (the autoscaler), ``loans`` (the Resource Broker's
elastic loans). ``processors/frontend/cli.py`` assembles them; what they share is ``processors/frontend/console.py``,
how they show things ``processors/frontend/render.py``."""

"""The CLI's commands of the control plane's components, one module each, its parser (``add_commands``) beside its
handlers: ``history`` (at, shadow, explain, history), ``intents`` (the Job Control Plane), ``srm`` (the autoscaler),
``loans`` (the Resource Broker's elastic loans). ``processors/frontend/cli.py`` registers them; what they share is
``processors/frontend/console.py``."""

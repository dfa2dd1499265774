"""The API's routes, one ``APIRouter`` per resource (``processors/api/app.py``'s table lists them all):
``meta`` (health, metrics, whoami), ``entitlements``, ``jobs``, ``machines`` (and power), ``maintenance``,
``rebalance``, ``intents``, ``srm``, ``loans``, ``history`` (the region at a moment, explain), ``log`` (replay, the
event streams). Each route acts through a ``Door`` (processors/api/door.py): the user, authorized per action, and the
front end as that user. ``create_app`` includes them in ``ROUTERS``' order."""

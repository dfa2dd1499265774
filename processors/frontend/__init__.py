"""The front end: the `ropewalk` CLI (and later the HTTP API). It validates user intent and produces it."""

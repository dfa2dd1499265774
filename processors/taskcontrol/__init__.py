"""TaskControl (Twine §2.5) and the rate limiter for destructive operations (§4). See README.md."""

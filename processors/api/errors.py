"""The API's refusal: an HTTP status, the reason constant that travels in the answer, and a one-line message.
Raised by the routes (processors/api/app.py) and shown by the web UI's refusal page (processors/api/ui)."""
from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.reason, self.message, self.headers = status, reason, message, headers

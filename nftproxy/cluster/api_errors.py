"""What an API failure was: its reason (a metric label) and its cause (a log line).

Layer: cluster (imports the kubernetes client's exception types). One job:
classify what list/watch raised -- TLS (the client turns an SSLError into
ApiException(status=0)), 401, 403, other HTTP answers, and urllib3's wrapped
transport errors -- and say it on one line; read Retry-After. Used by the
informer (cluster/informer.py).
"""

from __future__ import annotations

import json

import urllib3
from kubernetes.client.exceptions import ApiException

__all__ = ["classify", "describe", "retry_after", "status_message"]


def retry_after(exc: ApiException) -> float | None:
    """The Retry-After header of an HTTP error, in seconds (None if absent)."""
    value = (getattr(exc, "headers", None) or {}).get("Retry-After")
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date: use the backoff instead
        return None


def classify(exc: ApiException) -> tuple[str, str]:
    """(reason, cause) of an HTTP error or a TLS failure (the client turns
    an SSLError into ApiException(status=0)), the cause on one line."""
    status = exc.status or 0
    if status == 0:
        detail = str(exc.reason or "").split("\n", 1)[-1].replace("\n", " ")  # "SSLError\n..."
        return "tls", f"TLS: {detail} (check the CA, server name and client certificate)"
    message = status_message(exc)
    what = f"HTTP {status} {exc.reason}" + (f": {message}" if message else "")
    if status == 401:
        return "unauthorized", f"{what} (the API server rejected the credentials)"
    if status == 403:
        return "forbidden", f"{what} (RBAC: see deploy/'s ClusterRole)"
    return "http", what


def status_message(exc: ApiException) -> str:
    """The message of the Status object an HTTP error carries, if any."""
    try:
        body = json.loads(exc.body or b"{}")
    except (ValueError, TypeError):
        return ""
    return str(body.get("message") or "") if isinstance(body, dict) else ""


def describe(exc: BaseException) -> str:
    """The cause of a failure for the log: urllib3 wraps the useful part."""
    reason = getattr(exc, "reason", None)
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and reason is not None:
        exc = reason
    return f"{type(exc).__name__}: {exc}"

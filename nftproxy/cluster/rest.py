"""One API request through the kubernetes client, without its generated API classes.

Layer: cluster (edge). One job: send a request with an `ApiClient`'s
configuration (host, TLS, bearer token and its refresh hook, default
headers) and return the urllib3 response unread, or raise the client's
`ApiException` for an answer outside 2xx -- what the generated methods do
when called with `_preload_content=False` (`ApiClient._call_with_legacy_options`),
without calling them.

Why: in kubernetes 37 every generated API method is wrapped in pydantic's
`validate_call(defer_build=True)`, and its first call builds a validator
for the method's signature and imports the models that signature names.
The agent makes no other use of the generated classes, so sending the
requests here saves all of that memory and start time (bench/RESULTS.md,
"What moved the numbers").

Callers: cluster/informer.py (list and watch), cluster/kube_events.py
(create and patch Events). Needs kubernetes >= 37 (`param_serialize`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes.client.exceptions import ApiException

__all__ = ["Query", "QueryParam", "Timeout", "request"]

QueryParam = tuple[str, str | int | bool | None]
"""One query parameter; a None value is left out."""

Query = Sequence[QueryParam]
"""Query parameters, in order."""

Timeout = float | tuple[float, float]
"""urllib3's: total, or (connect, read) seconds."""

_ACCEPT = "application/json"


def request(
    api_client: Any,
    method: str,
    path: str,
    *,
    timeout: Timeout,
    query: Query = (),
    body: Mapping[str, Any] | None = None,
    content_type: str | None = None,
) -> Any:
    """Send `method path?query` (with `body` as JSON) and return the urllib3
    response, its body not yet read: the caller reads or streams it, then
    releases the connection. A non-2xx answer is read and raised as the
    client's ApiException, as the generated methods raise it."""
    headers = {"Accept": _ACCEPT}
    if content_type is not None:
        headers["Content-Type"] = content_type
    serialized = api_client.param_serialize(
        method=method,
        resource_path=path,
        query_params=[(k, v) for k, v in query if v is not None],
        header_params=headers,
        body=body,
        auth_settings=["BearerToken"],
    )
    answer = api_client.call_api(*serialized, _request_timeout=timeout)
    if not 200 <= answer.status <= 299:
        answer.read()
        raise ApiException.from_response(http_resp=answer, body=None, data=None)
    return answer.response

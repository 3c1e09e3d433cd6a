"""cluster/rest.py: one request through the kubernetes ApiClient, without
its generated (pydantic-validated) API methods, against the fake API server."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fakeapi import FakeApiServer
from kubernetes import client as k8s_client
from kubernetes.client.exceptions import ApiException

from nftproxy.cluster import rest

TIMEOUT = (2.0, 5.0)


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    with FakeApiServer() as server:
        yield server


def _service(name: str) -> dict[str, object]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": 80, "protocol": "TCP"}]},
    }  # fmt: skip


def test_get_returns_the_unread_response_and_sends_the_query(api: FakeApiServer) -> None:
    api.create(_service("web"))
    response = rest.request(
        api.api_client(), "GET", "/api/v1/services", timeout=TIMEOUT,
        query=(("limit", 500), ("continue", None), ("labelSelector", "!a"), ("watch", False)),
    )  # fmt: skip
    body = json.loads(response.data)
    response.release_conn()
    assert [i["metadata"]["name"] for i in body["items"]] == ["web"]
    seen = api.requests_of("services", "list")[-1]
    # None is left out; booleans are lower case, as the generated methods send them
    assert dict(seen.query) == {"limit": "500", "labelSelector": "!a", "watch": "false"}


def test_the_bearer_token_is_sent_as_the_generated_methods_send_it(api: FakeApiServer) -> None:
    config = k8s_client.Configuration(
        host=api.url, api_key={"authorization": "t0ken"}, api_key_prefix={"authorization": "Bearer"}
    )
    client = k8s_client.ApiClient(configuration=config)
    rest.request(client, "GET", "/api/v1/services", timeout=TIMEOUT).release_conn()
    assert api.requests_of("services", "list")[-1].authorization == "Bearer t0ken"


def test_an_answer_outside_2xx_raises_the_clients_api_exception(api: FakeApiServer) -> None:
    api.fail_requests(1, resource="services", status=503)
    with pytest.raises(ApiException) as failed:
        rest.request(api.api_client(), "GET", "/api/v1/services", timeout=TIMEOUT)
    assert failed.value.status == 503


def test_post_and_merge_patch_send_json_bodies(api: FakeApiServer) -> None:
    client = api.api_client()
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": "web.1", "namespace": "ns"},
        "involvedObject": {"kind": "Service", "name": "web", "namespace": "ns"},
        "reason": "R", "message": "m", "type": "Warning", "count": 1,
    }  # fmt: skip
    rest.request(client, "POST", "/api/v1/namespaces/ns/events", body=event, timeout=TIMEOUT)
    rest.request(
        client, "PATCH", "/api/v1/namespaces/ns/events/web.1", body={"count": 2},
        content_type="application/merge-patch+json", timeout=TIMEOUT,
    )  # fmt: skip
    got = rest.request(client, "GET", "/api/v1/namespaces/ns/events/web.1", timeout=TIMEOUT)
    assert json.loads(got.data)["count"] == 2

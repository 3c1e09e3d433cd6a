"""Shared fixtures. Tests that need the real kernel are marked `kernel` and
work inside the throwaway namespace of the `netns` fixture; helpers live in
tests/kernel.py."""

from __future__ import annotations

from collections.abc import Iterator

import kernel
import pytest

from nftproxy.kernel import netns as _netns


@pytest.fixture
def netns() -> Iterator[str]:
    """A fresh network namespace name, deleted after the test."""
    with kernel.fresh_netns() as name:
        yield name


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the `netns` fixture is a kernel test."""
    for item in items:
        if "netns" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.kernel)


@pytest.fixture(autouse=True)
def _kernel_tests_fail_without_root(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("kernel") is not None:
        kernel.require_root()


@pytest.fixture(scope="session", autouse=True)
def _no_leaked_namespaces() -> Iterator[None]:
    before = kernel.namespaces()
    yield
    leaked = kernel.leaked_namespaces(before)
    for name in leaked:  # report, and still leave the machine clean
        if _netns.exists(name):
            _netns.delete(name)
    if leaked:
        pytest.fail(f"network namespaces leaked by this test session: {leaked}", pytrace=False)

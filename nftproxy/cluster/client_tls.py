"""The API client's TLS: one SSL context, built once, built again when its files change.

Layer: cluster (edge: files, ssl, urllib3). One job: give a kubernetes
client's urllib3 pool manager the SSL context client-go would use
(`tls_context`) and keep it current (`RotatingTls`).

- The context holds the configured CA and the client certificate and key,
  loaded here. urllib3 is given none of their files: given them, it loads
  them into the one shared context again for every new connection, while
  other threads handshake with it, and OpenSSL's SSL_CTX is not safe to
  change that way (with a client certificate, the informers' first
  connects crashed the process).
- Rotation, as client-go's: before each request the CA, certificate and
  key files are looked at (a stat each); when one changed, a new context is
  built from them and installed for the connections made from then on
  (the pool manager's idle connections are dropped; a request in flight
  keeps its connection). Files that do not load (a rotation half-written)
  keep the previous context, with one WARNING per state of the files.
  Certificates given as data in a kubeconfig are written once to files by
  the client's loader and never change.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from typing import Any

from urllib3.util.ssl_ import create_urllib3_context

__all__ = ["RotatingTls", "tls_context"]

_LOADED_INTO_CONTEXT = ("ca_certs", "ca_cert_data", "cert_file", "key_file")
"""The pool keywords that would make urllib3 load files into the context per connection."""

FileState = tuple[tuple[int, int, int] | None, ...]
"""(inode, size, mtime ns) of each file the context was built from (None: absent)."""


def tls_context(configuration: Any) -> ssl.SSLContext:
    """The SSL context of the API client: what client-go (Go's crypto/x509)
    accepts. The server is verified against the configured CA (or the
    system's when none is configured) with hostname checking, but without
    VERIFY_X509_STRICT, which Python 3.13 and urllib3 >= 2.3 set by default
    and which rejects, e.g., a CA certificate without a keyUsage extension
    (common in self-made cluster CAs) that kube-proxy accepts. With
    VERIFY_X509_PARTIAL_CHAIN: Go trusts any certificate in its root pool,
    an intermediate CA included, as this flag does. insecure-skip-tls-verify
    (verify_ssl False) verifies nothing, as before. The CA and the client
    certificate and key are loaded here; files that cannot be loaded raise
    ValueError naming them."""
    verify = bool(configuration.verify_ssl)
    context = create_urllib3_context(cert_reqs=ssl.CERT_REQUIRED if verify else ssl.CERT_NONE)
    context.verify_flags = (
        context.verify_flags & ~ssl.VERIFY_X509_STRICT
    ) | ssl.VERIFY_X509_PARTIAL_CHAIN
    if verify:
        _load_ca(context, configuration)
    if configuration.cert_file:
        try:
            context.load_cert_chain(configuration.cert_file, configuration.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the client certificate {configuration.cert_file} "
                             f"and key {configuration.key_file}: {exc}") from exc
    return context


def _load_ca(context: ssl.SSLContext, configuration: Any) -> None:
    """The configured CA (file or data), else the system's."""
    ca_file = configuration.ssl_ca_cert or None
    ca_data = getattr(configuration, "ca_cert_data", None) or None
    if not (ca_file or ca_data):
        context.load_default_certs()  # urllib3 loads them only into its own contexts
        return
    try:
        context.load_verify_locations(cafile=ca_file, cadata=ca_data)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA {ca_file or '(data)'}: {exc}") from exc


def _files(configuration: Any) -> tuple[str, ...]:
    return tuple(path for path in (configuration.ssl_ca_cert, configuration.cert_file,
                                   configuration.key_file) if path)


def _state(paths: tuple[str, ...]) -> FileState:
    states: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            states.append(None)
        else:
            states.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(states)


class RotatingTls:
    """The TLS context of one pool manager, rebuilt when its files change.
    Make it with `install`; `refresh()` before each request."""

    def __init__(self, configuration: Any, manager: Any, paths: tuple[str, ...],
                 seen: FileState, log: logging.Logger) -> None:
        self._configuration = configuration
        self._manager = manager
        self._paths = paths
        self._seen = seen
        self._refused: FileState | None = None
        self._lock = threading.Lock()
        self.log = log

    @classmethod
    def install(cls, configuration: Any, manager: Any,
                log: logging.Logger | None = None) -> RotatingTls:
        """Build the context from `configuration`'s files (ValueError if they
        do not load), give it to urllib3 `manager` (and no file to load), and
        refresh it before each of the manager's requests."""
        paths = _files(configuration)
        seen = _state(paths)
        pool_kw = manager.connection_pool_kw
        pool_kw["ssl_context"] = tls_context(configuration)
        for loaded in _LOADED_INTO_CONTEXT:
            pool_kw.pop(loaded, None)
        tls = cls(configuration, manager, paths, seen, log or logging.getLogger(__name__))
        urlopen = manager.urlopen

        def refreshed_urlopen(*args: Any, **kwargs: Any) -> Any:
            tls.refresh()
            return urlopen(*args, **kwargs)

        manager.urlopen = refreshed_urlopen  # the one funnel of the client's requests
        return tls

    def refresh(self) -> bool:
        """A new context for the connections to come if a file changed and
        loads; True if so."""
        if not self._paths:
            return False
        state = _state(self._paths)
        if state == self._seen:
            return False
        with self._lock:
            if state == self._seen:
                return False
            try:
                context = tls_context(self._configuration)
            except ValueError as exc:
                if state != self._refused:
                    self._refused = state
                    self.log.warning("the API client's TLS files changed but do not load; "
                                     "keeping the previous ones: %s", exc)
                return False
            self._manager.connection_pool_kw["ssl_context"] = context
            self._manager.clear()  # idle connections go; new ones use the new context
            self._seen, self._refused = state, None
        self.log.info("the API client's TLS files changed; new connections use them",
                      extra={"files": ", ".join(self._paths)})
        return True

"""A throwaway Kubernetes node in network namespaces, for proving rules by traffic.

Layer: edge (test and demo tooling; imports netns only, never the proxier).
One job per module:

- `topology`: build and always remove the namespaces -- a node (forwarding,
  where nftproxy's tables go), pods wired to it by veth with host routes (or
  a bridge), and an external client with several source addresses;
- `addresses`: the address plan those use, and the Spec/Pod values;
- `backends`: the tiny server each pod runs (`python -m
  nftproxy.tools.sandbox.backends`): every TCP connection, UDP datagram or SCTP
  association is answered with "<pod> peer=<ip>:<port>", so a test sees which
  endpoint answered and whether the source was masqueraded;
- `probe`: the client (`python -m nftproxy.tools.sandbox.probe`), run inside any
  of the namespaces; many attempts per process, one JSON report.

Used by tests/test_dataplane*.py; meant for vmtests/, bench/ and the demo too.
Importing this package is cheap: the subprocess entry points import only the
standard library.
"""

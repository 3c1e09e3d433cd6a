"""nftproxy: a Kubernetes service proxy that programs kube-proxy's KUBE-* semantics with nftables."""

__version__ = "0.1.0"

"""nftproxy: a Kubernetes service proxy programming kube-proxy's KUBE-* semantics in nftables."""

__version__ = "0.1.0"

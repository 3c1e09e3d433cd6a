"""Cluster sources: the API server (kube.py, informer.py) and files (file.py).

Importing this package registers the `kubernetes` package and its `config`
subpackage without running their __init__ (nftproxy/bare_packages.py):
`kubernetes/__init__.py` imports the dynamic client, watch, stream, leader
election, informer and utils modules, and `kubernetes/config/__init__.py`
the kubeconfig loader, which imports requests, requests-oauthlib and
oauthlib. The agent needs the client, its exceptions, the in-cluster
loader, and the kubeconfig loader only off-cluster (cluster/kube.py
imports it when used), so skipping the rest shortens the start and lowers
its memory (bench/RESULTS.md, "What moved the numbers"). Every module here
takes a kubernetes name from the module defining it.
"""

from nftproxy.bare_packages import register

register("kubernetes", "kubernetes.config")

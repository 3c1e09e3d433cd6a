"""Multi-node integration tests: the scenarios, their two drivers (network
namespaces on one machine, or real VMs), the VM node daemon and the runner.
See vmtests/README.md."""

"""Benchmarks: the cluster bench (``metalog bench``, with etcd side by side) and the focused ones."""

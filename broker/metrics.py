"""Prometheus metrics of one broker (its own registry, served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CORRUPTION_SOURCES = ("startup", "scrub", "read", "fetch")
ROLES = ("unattached", "voted", "prospective", "candidate", "leader", "follower", "resigned", "observer")


class BrokerMetrics:
    def __init__(self, node_id: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("metalog_requests_total", "Requests received, by api", ["api"], registry=r)
        self.authorization_failures = Counter(
            "metalog_authorization_failures_total", "Requests refused by the authorizer, by api", ["api"], registry=r)
        self.appended_records = Counter("metalog_client_records_total", "Client records accepted for append", registry=r)
        self.appended_bytes = Counter("metalog_log_appended_bytes_total", "Bytes appended to the local log", registry=r)
        self.flush_seconds = Histogram(
            "metalog_log_flush_seconds", "fdatasync latency of the log", registry=r,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1.0),
        )
        self.high_watermark = Gauge("metalog_high_watermark", "High watermark (exclusive)", registry=r)
        self.epoch = Gauge("metalog_leader_epoch", "Current epoch", registry=r)
        self.role = Gauge("metalog_role", "1 for the current role", ["role"], registry=r)
        self.snapshot_generation_seconds = Histogram(
            "metalog_snapshot_generation_seconds", "Time to write a controller snapshot", registry=r)
        self.snapshot_load_seconds = Histogram(
            "metalog_snapshot_load_seconds", "Time to load or install a snapshot", registry=r)
        self.snapshot_bytes = Gauge("metalog_snapshot_bytes", "Size of the latest snapshot written", registry=r)
        self.scrub_bytes = Counter("metalog_scrub_bytes", "Bytes of sealed segments and snapshots re-read by the scrubber",
                                   registry=r)
        self.scrub_last_complete_pass = Gauge(
            "metalog_scrub_last_complete_pass_timestamp_seconds",
            "Unix time the scrubber last finished a pass over all sealed data", registry=r)
        self.corrupt_batches = Counter(
            "metalog_corrupt_batches", "Corrupt batches (or snapshot files) found, by where they were found",
            ["source"], registry=r)
        for source in CORRUPTION_SOURCES:
            self.corrupt_batches.labels(source=source)
        self.consistency_checks = Counter(
            "metalog_consistency_checks_total", "Cross-replica consistency checks run by this leader, by result "
            "(match, mismatch, skipped, failed)", ["result"], registry=r)
        self.divergence_detected = Counter(
            "metalog_divergence_detected_total", "Committed log ranges found to differ from a voter's "
            "(equal offsets, different digests)", ["replica"], registry=r)

    def set_role(self, role: str, epoch: int) -> None:
        for name in ROLES:
            self.role.labels(role=name).set(1 if name == role else 0)
        self.epoch.set(epoch)

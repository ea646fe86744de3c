"""The broker process: main, the runtime driver around the quorum core, produce path, recovery, snapshots, admin API, metrics, config."""

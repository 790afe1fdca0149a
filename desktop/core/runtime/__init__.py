"""Engine processes while they live: supervision, process-tree stops, orphan guards, ports and telemetry."""

"""In-process fakes of the remote provider APIs, so end-to-end tests and benchmarks run offline."""

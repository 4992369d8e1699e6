"""Shared-state engines for several replicas: Redis (limits, quotas, dedup, cache)."""

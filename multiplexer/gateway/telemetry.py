"""Choose the call path's tracer from config and the standard ``OTEL_*`` variables.

Off (the core's no-op tracer) unless an OTLP endpoint is named; only then is
OpenTelemetry imported, so a gateway without traces pays nothing for them.
"""

from __future__ import annotations

import os

from multiplexer.core.tracing import NOOP, Tracer
from multiplexer.gateway.config import ConfigError, TelemetryConfig

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def wanted(conf: TelemetryConfig, env: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    if conf.enabled is False or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return False
    return bool(conf.otlp_endpoint or any(env.get(v) for v in ENDPOINT_VARS))


def tracer_for(conf: TelemetryConfig) -> Tracer:
    if not wanted(conf):
        return NOOP
    try:
        from multiplexer.gateway.otel import exporting_tracer
    except ImportError as e:
        raise ConfigError(f"telemetry: traces need the otel extra (pip install "
                          f"'multiplexer[otel]'): {e}") from None
    return exporting_tracer(conf.otlp_endpoint, conf.service_name)

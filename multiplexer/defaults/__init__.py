"""What ``multiplexer serve`` and ``demo`` run without ``--config``: ``default.yaml`` and the MCP
upstream it starts (``demo_tools.py``), shipped in the package so they work from any folder."""

from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "default.yaml"

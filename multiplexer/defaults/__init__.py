"""What ``multiplexer serve`` and ``demo`` run without ``--config``: ``default.yaml`` and the MCP
upstream it starts (``demo_tools.py``), shipped in the package. The upstream is started as a module
(``python -m multiplexer.defaults.demo_tools``), not as a script beside the file, so the file and
any copy of it work from any folder."""

from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent / "default.yaml"

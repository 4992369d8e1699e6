"""The dashboard face: `/ui` (static page) and its JSON and Server-Sent Events (docs/dashboard.md)."""

from multiplexer.faces.ui.face import close_streams, ui_routes

__all__ = ["close_streams", "ui_routes"]

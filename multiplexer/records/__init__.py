"""Records written off the hot path: a generic sink (``sink.py``) and the request log."""

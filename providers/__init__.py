"""Upstream kinds, one module each, found by ``kind`` through ``registry``."""

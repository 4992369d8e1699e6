"""The package version, importable from anywhere without pulling in the SDK."""

VERSION = "0.1.0"

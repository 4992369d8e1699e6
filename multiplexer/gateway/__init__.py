"""The composition root: config loading, the provider registry and the Gateway that runs the call path."""

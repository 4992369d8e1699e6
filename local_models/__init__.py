"""A pool of local PyTorch + transformers models that batches by itself.

Only ``providers.local`` imports this package, lazily, when a ``kind: local``
provider starts; the torch-free modules (``spec``, ``prepared``, ``formation``,
``sources``) may be imported anywhere, the rest pull in torch and transformers.
"""

"""The durable job engine's store: jobs, their items and parts, in SQLite or PostgreSQL
(``store.url``), shared by the providers' job managers and the faces."""

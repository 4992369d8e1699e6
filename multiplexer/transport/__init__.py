"""HTTP/1.1 client transport shared by the providers and the SDK."""

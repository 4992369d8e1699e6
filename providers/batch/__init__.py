"""Asynchronous batch APIs (OpenAI Batch, Anthropic Message Batches) behind durable jobs."""

"""The gateway: the OpenAI-compatible HTTP front of Tandem."""

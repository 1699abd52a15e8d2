"""Shared libraries: config, protocol, model, KV blocks, connector, sampling."""

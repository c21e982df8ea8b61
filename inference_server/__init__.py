"""Riptide's embedded inference server: continuous batching, SGLang-native HTTP API, hot reload."""

"""The OpenAI-compatible server: HTTP app, the bridge to the serving loop, Prometheus metrics."""

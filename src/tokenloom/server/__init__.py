"""The OpenAI-compatible HTTP server: endpoints, authentication, admission errors and Prometheus metrics."""

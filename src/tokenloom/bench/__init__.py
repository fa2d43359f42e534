"""Load generation and scorecards: production-shaped traces, an OpenAI-compatible streaming client, the scorecard."""

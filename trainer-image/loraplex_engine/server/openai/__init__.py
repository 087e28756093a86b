"""The OpenAI-compatible endpoints and their wire types."""

"""The routing gateway: an OpenAI-compatible proxy that routes by the project's router plugins (``main``)."""

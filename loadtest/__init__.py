"""Locust load tests for any cbserve (or OpenAI-compatible) endpoint, with reports a person reads."""

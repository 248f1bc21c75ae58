"""Modules a test imports as a user's plugin would be imported."""

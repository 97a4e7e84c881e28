"""Hosts outside this package that run the controller (`adaptive_spec.control`).

Each integration is optional: it imports its host lazily, and the core package never imports it.
"""

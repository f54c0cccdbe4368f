"""Process-wide configuration and errors of the service."""

"""Alembic migrations (installed as service.migrations)."""

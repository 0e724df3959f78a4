"""Revision files (Alembic ignores this module)."""

"""Alembic revisions for the feedback database (run them with `rtrl db upgrade`)."""

from pathlib import Path

SCRIPT_LOCATION = Path(__file__).resolve().parent
"""The Alembic script directory, found through the package so commands work from any directory."""

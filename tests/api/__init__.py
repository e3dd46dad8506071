"""Tests of the control-plane API (`api/`, `migrations/`): fast, in-process, over SQLite and PostgreSQL."""

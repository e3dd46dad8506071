"""Tests of the control-plane API (`api/`, its `migrations/`): fast, in-process, over SQLite and PostgreSQL."""

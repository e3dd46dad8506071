"""Domain logic of the control plane, free of FastAPI.

Each service function is one use case and owns its transaction: it takes an `AsyncSession`, does its reads and
writes, and commits (or raises a `ServiceError`, leaving the caller's session to roll back). Routes only translate
HTTP to calls and results to schemas, so the same logic serves the CLI, negotiations and tests.
"""

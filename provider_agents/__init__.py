"""Provider host agents: telemetry, per-tenant projection, publishing, node launching (filled by later issues)."""

"""The tenant SDK and example controllers (filled by the macro-loop issue)."""

"""Test-only code the package loads on request (never on a production path): fault injection."""
